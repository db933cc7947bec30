"""Scratch directories that outlive a killed process: swept by the next one, never a live one's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pulsenet.fsutil import _pid_namespace, private_scratch

NS = _pid_namespace()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_private_scratch_sweeps_what_dead_processes_left_and_nothing_else(tmp_path: Path) -> None:
    dead = tmp_path / f"pulsenet-vllm-{NS}.{_dead_pid()}-abc123"
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "update-3.safetensors").write_bytes(b"\0" * 4096)  # a handoff a kill left
    live = tmp_path / f"pulsenet-vllm-{NS}.{os.getppid()}-def456"  # another live process's (our parent)
    live.mkdir()
    elsewhere = tmp_path / f"pulsenet-vllm-{NS + 1}.{_dead_pid()}-ghi789"  # another PID namespace's
    elsewhere.mkdir()
    older = tmp_path / "pulsenet-vllm-791ef_oy"  # no pid in the name: not ours to judge
    older.mkdir()
    other = tmp_path / f"pulsenet-data-{NS}.{_dead_pid()}-x"  # another prefix
    other.mkdir()
    a_file = tmp_path / f"pulsenet-vllm-{NS}.{_dead_pid()}-file"  # not a directory
    a_file.write_bytes(b"1")

    made = private_scratch(tmp_path, "pulsenet-vllm-")

    assert not dead.exists()
    assert live.is_dir() and elsewhere.is_dir() and older.is_dir() and other.is_dir() and a_file.is_file()
    assert made.is_dir() and made.parent == tmp_path and made.name.startswith(f"pulsenet-vllm-{NS}.{os.getpid()}-")
    assert made.stat().st_mode & 0o777 == 0o700
    again = private_scratch(tmp_path, "pulsenet-vllm-")  # this process is alive: its first one stays
    assert made.is_dir() and again != made


def test_private_scratch_makes_a_missing_parent_an_error_not_a_sweep(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        private_scratch(tmp_path / "missing", "pulsenet-vllm-")
