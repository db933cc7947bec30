"""Issue 38's hostile review, each defect reproduced and closed: a malformed group id with re-scoring
off, thousands of planted checkpoint names, and a peer's text in ``pulsenet up``'s console. (An open
node publishing another's key: tests/integration/test_rollouts_trust.py; zero-padded aliases:
tests/unit/test_answers.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from pulsenet.codec.rollout import decode_columns, encode_batch
from pulsenet.errors import RolloutRowError
from pulsenet.loco.layout import LocoLayout
from pulsenet.nodes.build import compose_trainer
from pulsenet.nodes.common import text_codec
from pulsenet.nodes.config import TrainerConfig
from pulsenet.nodes.up.config import UpConfig
from pulsenet.nodes.up.supervisor import Supervisor
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.models import BYTE_PAD, build_tiny_model
from pulsenet.rl.replay import ReplayConfig
from pulsenet.rl.tasks import build_task
from pulsenet.rollouts import RolloutIntakeConfig, RolloutSource
from pulsenet.store import LocalStore
from tests.support.peer import RUN, TASK, Site, batch_rows


def test_a_malformed_group_id_is_refused_at_intake_with_rescore_off(tmp_path: Path) -> None:
    """With ``rescore = false`` a signed batch of group ``g0`` passed intake (only group sizes were
    checked), then made the trainer's replay raise, again after every restart. The intake's batch
    check is now the same whatever ``rescore`` says."""
    net = Site(tmp_path, "t0", "i0")
    node = compose_trainer(
        TrainerConfig(
            id="t0", run=RUN, rescore=False, rows_per_step=8, prompts_per_batch=2, state_dir=tmp_path / "t0",
            intake=RolloutIntakeConfig(group_size=4), replay=ReplayConfig(enabled=True),
        ),
        store=net.store("t0"), key=net.keys["t0"], sources=[RolloutSource("i0", net.store("i0"), net.trusted("i0"))],
        policy=GRPOInner(GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3, pad_id=BYTE_PAD))),
        task=build_task(TASK, seed=0), text=text_codec("tiny"),
    )  # fmt: skip
    check = node.intake.answer_of
    assert check is not None
    honest = batch_rows(0, "ab" * 32, 1)
    assert check(decode_columns(encode_batch(honest)), ()) == "v0-b1"
    for bad in ("g0", "i0-v0-b1-p00"):
        rows = [dataclasses.replace(r, group=bad if r.group.endswith("p0") else r.group) for r in honest]
        with pytest.raises(RolloutRowError) as e:
            check(decode_columns(encode_batch(rows)), ())
        assert e.value.reason == "group_id"


async def test_thousands_of_planted_checkpoint_names_cost_a_restart_a_bounded_number_of_gets(tmp_path: Path) -> None:
    from pulsenet.loco import RoundStore
    from pulsenet.loco.documents import CHECKPOINT_READS, trainer_keys
    from pulsenet.signing import load_private_key
    from tests.support.loco_helpers import make_keys

    priv, pubs = make_keys(tmp_path / "keys", ("t0",))
    store = LocalStore(tmp_path / "store")
    rs = RoundStore(store, "t0", load_private_key(priv["t0"]), trainer_keys(pubs))
    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(b"resume point")
    await rs.publish_checkpoint(2, ckpt)
    layout = LocoLayout()
    await asyncio.gather(*(store.put(layout.checkpoint_manifest("t0", r), b"junk") for r in range(1, 3001) if r != 2))
    gets: list[str] = []
    real = store.get

    async def get(key: str, **kw: Any) -> bytes:
        gets.append(key)
        return await real(key, **kw)

    store.get = get  # type: ignore[method-assign]
    assert await rs.latest_checkpoint() is None  # hidden behind 2,998 newer names, as a deletion would
    assert len(gets) == CHECKPOINT_READS  # before: 2,999 GETs in sequence
    for r in range(3, 3001):
        await store.delete([layout.checkpoint_manifest("t0", r)], timeout=10)
    got = await rs.latest_checkpoint()
    assert got is not None and got[0] == 2


def test_a_peer_chosen_markup_in_a_nodes_error_is_printed_as_text() -> None:
    """``say`` quoted a node's last error into rich markup: ``[/x]`` raised MarkupError and ended
    ``pulsenet up`` and its nodes."""
    out = io.StringIO()
    sup = Supervisor(UpConfig(model="tiny"), [], Console(file=out, width=200))
    sup.say("i1 failed: RolloutError: group [/x] [bold]not[/bold] [/]")
    assert "i1 failed: RolloutError: group [/x] [bold]not[/bold] [/]" in out.getvalue()


async def test_a_check_that_raises_unforeseen_refuses_its_batch_instead_of_failing_every_poll() -> None:
    """Whatever makes a check raise is a refusal (``payload_malformed``), decided once like any
    other: before, it failed the poll, and the batch was fetched again at every poll."""
    from pulsenet.rollouts import checks
    from pulsenet.rollouts.layout import RolloutLayout
    from pulsenet.rollouts.manifest import BatchManifest
    from pulsenet.rollouts.rows import RowLimits
    from pulsenet.signed import ObjectRef
    from tests.support.rollouts import make_rows

    rows = make_rows("inf-a", 1)
    data = encode_batch(rows)
    m = BatchManifest(
        node="inf-a", seq=0, version=1, model_digest=rows[0].model_digest,
        payload=ObjectRef(RolloutLayout().batch(1, "inf-a", 0, "c" * 64), len(data), "c" * 64), rows=len(rows),
        groups=2, tokens=sum(len(r.prompt_ids) + len(r.completion_ids) for r in rows), publisher="k", created="now",
    )  # fmt: skip

    def raises(columns: Any, dropped: Any) -> str:
        raise IndexError("a case nobody foresaw")

    got = await checks.read_rows(m, data, RowLimits(), raises)
    assert isinstance(got, checks.Refusal) and got.reason == "payload_malformed" and "IndexError" in got.why
