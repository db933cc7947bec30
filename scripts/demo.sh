#!/usr/bin/env bash
# Set up .venv and run the main job: `pulsenet up`, a local network on this machine. An embedded
# SeaweedFS S3 server, two trainers and two inference nodes as separate processes (each with its
# own bucket and credentials; the trainers also share a PULSELoCo bucket), 60 rounds of
# asynchronous GRPO on the tiny model (8 GRPO steps per trainer per round, averaged by PULSELoCo),
# then the reward curve, PULSESync bytes vs full checkpoints, PULSELoCo bytes vs DiLoCo and DDP,
# sparsity and every node's verified digest; the report (summary.json, reward.png, bytes.png,
# sparsity.png) goes to the directory printed at the end. `scripts/demo.sh --trainers 1` runs one
# trainer; `scripts/demo.sh --model smollm2 --trainers 1` is the realistic run; `pulsenet up
# --help` lists every setting.
# The codec benchmark that used to live here is `pulsenet bench sync --model smollm2`.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" dev
REPORT="${REPORT_DIR:-$ROOT/up-report}"
echo ">> pulsenet up: work directory $ROOT/.pulsenet-up, report in $REPORT"
pulsenet up --workdir "$ROOT/.pulsenet-up" --report "$REPORT" "$@"
echo ">> report: $REPORT"
