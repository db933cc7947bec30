#!/usr/bin/env bash
# Cross-check the PyTorch and vLLM engines on SmolLM2-135M on one CUDA device (pulsenet/engines/gpu_check.py):
# same greedy tokens, logprobs within BF16 kernel tolerance, weights at the published digest, before and
# after 3 verified patches; times each update; prints JSON (also written to ${OUT:-gpu_check.json}).
# Exit 2 (with the reason) when there is no CUDA device or vLLM is missing: install it with
#   pip install -e '.[vllm]'   (a CUDA build of torch comes with it)
# Extra arguments go to the Python script, e.g. --engines torch (no vLLM) or --max-new-tokens 64.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec "$PY" -m pulsenet.engines.gpu_check --model smollm2 --device cuda --engines torch,vllm \
    --patches 3 --json "${OUT:-gpu_check.json}" "$@"
