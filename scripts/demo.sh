#!/usr/bin/env bash
# Set up .venv and run the main job: the PULSESync codec benchmark on real SmolLM2-135M weights.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" dev
# BF16 autocast training steps are slow on CPUs without native BF16 (about a minute each on 2 cores):
# the default is 4 steps of batch 2 x 32 tokens; `scripts/demo.sh --steps 8 --batch 4 --seq 64` for the full run.
pulsenet bench sync --model smollm2 --steps 4 --batch 2 --seq 32 --json "${JSON_OUT:-bench-sync.json}" "$@"
