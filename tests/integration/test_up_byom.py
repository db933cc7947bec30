"""Bring your own model and data to ``pulsenet up`` (issue 22's proof): a local Hugging Face
directory of a Llama and of a GPT-2 architecture (random, 2 layers, SmolLM2's real tokenizer), a
JSONL dataset whose columns are not named problem/answer, the ``math`` reward; one trainer, two
inference nodes, three versions, on the session's SeaweedFS so the store outlives the run. Then
``pulsenet export`` of the last version loads with ``from_pretrained`` and its weights hash to the
published digest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pulsenet.codec.digest import model_digest
from pulsenet.nodes.events import read_events
from pulsenet.nodes.up.workdir import MARKER
from pulsenet.rl.models import bf16_state_dict
from tests.support.model_dirs import gpt2_dir, llama_dir

pytestmark = pytest.mark.integration


def _dataset(path: Path) -> Path:
    rows = [{"question": f"{a}+{b}=", "solution": f"\\boxed{{{a + b}}}"} for a in range(10) for b in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_up_runs_your_model_on_your_data_and_exports_it(family: str, seaweed, tmp_path: Path) -> None:
    model = (llama_dir if family == "llama" else gpt2_dir)(tmp_path / family)
    data = _dataset(tmp_path / "sums.jsonl")
    work = tmp_path / "up"
    work.mkdir()
    (work / MARKER).write_text("")
    admin = seaweed.config("admin")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PULSENET_", "AWS_"))} | {
        "AWS_ACCESS_KEY_ID": admin.access_key_id,
        "AWS_SECRET_ACCESS_KEY": admin.secret_access_key,
        "AWS_REGION": admin.region,
    }
    prefix = f"byom-{family}-{os.getpid()}-"
    up = subprocess.run(
        [sys.executable, "-m", "pulsenet", "up", "--workdir", str(work), "--no-live", "--report", str(tmp_path / "r"),
         "--model", str(model), "--task", str(data), "--reward", "math", "--eval-fraction", "0.1", "--eval-every", "3",
         "--trainers", "1", "--rounds", "3", "--prompts", "4", "--group-size", "4", "--rows-per-step", "16",
         "--max-new-tokens", "8", "--s3-endpoint", seaweed.endpoint_url, "--bucket-prefix", prefix],
        env=env, capture_output=True, text=True, timeout=800, check=False,
    )  # fmt: skip
    assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert all(summary["checks"].values()), summary["checks"]
    nodes = summary["nodes"]
    assert {d["version"] for d in nodes.values()} == {3} and len({d["digest"] for d in nodes.values()}) == 1
    assert [e["version"] for e in summary["eval"]] == [0, 3] and all(e["n"] == 10 for e in summary["eval"])
    published = [e for e in read_events(work / "state" / "t0" / "events.jsonl") if e.kind == "published"]
    assert all(e.steps for e in published[1:]), "every version after v0 is a GRPO step on the dataset"

    # The last version, exported from the store as a Hugging Face directory, loads and hashes to its digest.
    trainer = tomllib.loads((work / "config" / "t0.toml").read_text())["trainer"]
    out = tmp_path / "exported"
    exported = subprocess.run(
        [sys.executable, "-m", "pulsenet", "export", "--store", trainer["store"], "--run", trainer["run"],
         "--trust", str(work / "keys" / "t0.key.pub"), "--model", str(model), "--version", "latest", "--out", str(out)],
        env=env | {"AWS_ENDPOINT_URL": seaweed.endpoint_url}, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert exported.returncode == 0, (exported.stdout + exported.stderr)[-3000:]
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert model_digest(bf16_state_dict(loaded)) == published[-1].digest == nodes["i0"]["digest"]
    # Without --model the architecture is the one the trainer signed into the channel's anchors (issue 29).
    bare = tmp_path / "exported-bare"
    exported = subprocess.run(
        [sys.executable, "-m", "pulsenet", "export", "--store", trainer["store"], "--run", trainer["run"],
         "--trust", str(work / "keys" / "t0.key.pub"), "--version", "latest", "--out", str(bare)],
        env=env | {"AWS_ENDPOINT_URL": seaweed.endpoint_url}, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert exported.returncode == 0, (exported.stdout + exported.stderr)[-3000:]
    assert model_digest(bf16_state_dict(AutoModelForCausalLM.from_pretrained(bare))) == published[-1].digest
