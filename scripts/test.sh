#!/usr/bin/env bash
# Install everything the tests need (from this repo's own files) and run lint + the whole suite.
# Servers (the embedded SeaweedFS S3) are started by the pytest fixtures on 127.0.0.1.
# Layout: tests/unit (in one process, no servers), tests/integration (SeaweedFS, node and CLI processes,
# `pulsenet up`, torchrun, vLLM), tests/fuzz, tests/golden; helpers in tests/support (`tests.support.x`),
# fixtures in tests/conftest.py. Arguments go to pytest: `scripts/test.sh tests/unit` runs the unit tests.
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
