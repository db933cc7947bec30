#!/usr/bin/env bash
# Set up .venv and run the main job: the PULSESync codec benchmark on real SmolLM2-135M weights.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" dev
pulsenet bench sync --model smollm2 --steps "${STEPS:-8}" --json "${JSON_OUT:-bench-sync.json}" "$@"
