"""``pulsenet patch encode|apply --base-digest``: a base the caller already verified is not hashed
again, the patch is byte-identical to the one made hashing it, and a wrong digest is refused."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import torch

from pulsenet.checkpoint import Checkpoint, save_state
from pulsenet.codec.bf16 import bits
from pulsenet.codec.digest import model_digest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pulsenet", *args], capture_output=True, text=True, timeout=120)


def test_base_digest_skips_hashing_and_changes_no_byte(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(300, 200, generator=g).to(torch.bfloat16), "n": torch.ones(64, dtype=torch.bfloat16)}
    b = {"w": a["w"].clone(), "n": a["n"].clone()}
    b["w"][::3, ::7] += 0.05
    save_state(tmp_path / "a.safetensors", a)
    save_state(tmp_path / "b.safetensors", b)
    da = model_digest(a)
    old, new = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    assert run_cli("patch", "encode", old, new, "-o", str(tmp_path / "p1")).returncode == 0
    r = run_cli("patch", "encode", old, new, "-o", str(tmp_path / "p2"), "--base-digest", da, "--threads", "1")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "p1").read_bytes() == (tmp_path / "p2").read_bytes()

    out = tmp_path / "out.safetensors"
    r = run_cli("patch", "apply", old, str(tmp_path / "p2"), "-o", str(out), "--base-digest", da)
    assert r.returncode == 0, r.stderr
    rebuilt = Checkpoint(out)
    assert all(np.array_equal(bits(rebuilt[k]), bits(b[k])) for k in b)

    r = run_cli("patch", "apply", old, str(tmp_path / "p2"), "-o", str(tmp_path / "x.safetensors"),
                "--base-digest", "0" * 64)
    assert r.returncode != 0 and "BaseMismatchError" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()
