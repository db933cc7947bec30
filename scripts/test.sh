#!/usr/bin/env bash
# Install everything the tests need (from this repo's own files) and run lint + the whole suite.
# Servers (the embedded SeaweedFS S3) are started by the pytest fixtures on 127.0.0.1.
# Layout: tests/unit (in one process, no servers), tests/integration (SeaweedFS, node and CLI processes,
# `pulsenet up`, torchrun, vLLM), tests/fuzz, tests/golden; helpers in tests/support (`tests.support.x`),
# fixtures in tests/conftest.py. Arguments go to pytest: `scripts/test.sh tests/unit` runs the unit tests.
# A full disk fails the suite in confusing places (pip's "No space left on device", the embedded
# SeaweedFS answering InternalError: "No writable volumes"): say so first.
for where in "$(dirname "${BASH_SOURCE[0]}")" "${TMPDIR:-/tmp}"; do
    free_kb=$(df -Pk "$where" 2>/dev/null | awk 'NR==2 {print $4}')
    if [ -n "$free_kb" ] && [ "$free_kb" -lt $((8 * 1024 * 1024)) ]; then
        echo "warning: $((free_kb / 1024)) MiB free under $where; the suite (venv, SeaweedFS volumes, vLLM, images) needs about 8 GiB" >&2
    fi
done
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" dev
echo ">> ruff"
ruff check pulsenet tests
echo ">> pytest"
# -m 'not slow' keeps CI bounded; set PULSENET_SLOW=1 for the full soak/chaos runs.
marker="not slow"
[ "${PULSENET_SLOW:-0}" = "1" ] && marker=""
set +e
# Two workers (pytest-xdist): most tests wait on processes and the store; PULSENET_TEST_WORKERS=0 runs in one.
python -m pytest -q -m "$marker" -n "${PULSENET_TEST_WORKERS:-2}" --durations=25 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    exit 1
fi
exit "$rc"
