"""What a peer holding a valid key can make a node do, at the node level (issue 21): real nodes
(``InferenceNode``, ``TrainerNode``) on a ``LocalStore`` with the tiny model, fed by a peer that
signs what it sends with a key the node trusts.

- a trusted trainer's signed head for v999999999999 (item 6): the inference node deletes none of
  its batches and does not switch to that channel;
- a rollout batch with a reward of 1e300 (item 2): no published version is ever non-finite (and
  behind the intake, the step's own guard);
- a rollout batch whose token ids are past the vocabulary, or one whose step raises (item 1): the
  trainer keeps running, drops it with a counted reason, and after a restart does not take it again.

docs/security.md ("Signed peer") lists each claim with its test.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pulsenet.nodes.config import InferenceConfig
from pulsenet.nodes.rounds import finite
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.models import BYTE_PAD, BYTE_VOCAB, build_tiny_model
from pulsenet.rl.tasks import TaskConfig
from pulsenet.sync import Publisher, PublisherConfig, Subscriber, SubscriberConfig
from pulsenet.sync.manifest import Head, sign_head
from tests.support.peer import RUN, Site, Trainer, batch_rows, stop_node
from tests.support.waiting import wait_until

FAR = 999_999_999_999
"""The largest version a manifest may carry: what a compromised key announces."""

pytestmark = pytest.mark.timeout(240)


# --- item 6: a signed head far ahead -----------------------------------------------------------


async def test_a_signed_head_far_ahead_deletes_no_batch_and_moves_no_channel(tmp_path: Path) -> None:
    """Both trainers the inference node trusts sign a head for v999999999999 on their channels,
    with no manifest behind it. The node keeps serving v1 (what it verified), keeps every batch it
    writes (retention by that verified v1), reports staleness 0, and when its channel stalls does
    not fail over to the other channel (whose head "is newer" only by the signer's word)."""
    net = Site(tmp_path, "t0", "t1", "i0")
    grpo = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3, pad_id=BYTE_PAD))
    states = [grpo.bf16_state()]
    states.append({n: (t.float() + 0.01).to(t.dtype) if n.endswith("weight") else t for n, t in states[0].items()})
    publishers = {}
    for t in ("t0", "t1"):  # both publish the same honest v0 and v1 (bit-identical global weights)
        pub = Publisher(net.store(t), net.keys[t], PublisherConfig(run=RUN))
        await pub.start()
        for v, state in enumerate(states):
            await pub.publish_now(state, step=v)
        await pub.close(flush_timeout=30)
        publishers[t] = pub
        # ... then the key signs a head announcing a version no manifest backs.
        head = Head(version=FAR, model_digest=pub.digest, publisher=pub.key_id, time_ms=int(time.time() * 1000))  # type: ignore[arg-type]
        await net.store(t).put(pub.layout.head, sign_head(head, net.keys[t], context=pub.layout.context))

    node = net.inference_node(
        InferenceConfig(
            id="i0",
            run=RUN,
            prompts=2,
            group_size=2,
            task=TaskConfig(max_new_tokens=2),
            batches_per_version=3,
            max_staleness=1,
            state_dir=tmp_path / "i0",
            subscribe=SubscriberConfig(interval_s=0.1),
            failover_s=0.3,  # its channel brings nothing newer: it looks at the other one
            status_every_s=0.5,
        )
    )
    stop = asyncio.Event()
    task = asyncio.create_task(node.run(stop))
    active, other = node.subscribers
    try:
        await wait_until(
            lambda: other.stats.polls > 0 or (node.writer.stats.batches >= 3 and other.stats.announced_unverified >= 2),
            120,
            "3 batches and 2 failover looks",
            task=task,
        )
        # No failover: the other channel was asked (and refused the head) but never followed.
        assert other.stats.polls == 0 and other.version is None
    finally:
        await stop_node(stop, task)

    assert active.stats.head_version == FAR  # the hostile head was read ...
    assert node.engine is not None and node.engine.version == 1 and node.state.version == 1  # ... v1 served
    # Retention went by the verified v1: nothing deleted, every batch still listed in its store.
    assert node.writer.stats.deleted == 0
    listed = await net.store("i0").list(node.writer.layout.manifests)
    assert len(listed) == node.writer.stats.batches >= 3
    assert node.state.staleness == 0
    assert other.stats.announced_unverified >= 2
    assert node.served[-1] == (1, publishers["t0"].digest) and {v for v, _ in node.served} <= {0, 1}


# --- items 1 and 2: rollout batches a trusted inference key signed -----------------------------


async def _subscribe_newest(net: Site) -> tuple[int, dict[str, torch.Tensor]]:
    """The newest version of t0's channel as an inference node gets it: verified."""
    got: dict[str, Any] = {}
    config = SubscriberConfig(run=RUN)
    async with Subscriber(net.store("t0"), net.trusted("t0"), config, on_update=lambda v, s, d, **_: got.update(v=v, s=s)) as sub:
        await sub.sync_once()
    return got["v"], got["s"]


async def test_a_reward_of_1e300_never_reaches_a_step_nor_a_published_version(tmp_path: Path) -> None:
    """A reward of 1e300 is finite as float64 and inf in float32: the trainer published a version
    whose every weight was NaN. Now the intake refuses a reward outside the task's range
    (``reward_range``, counted for the node), and the node trains on the honest batches; every
    version it publishes, and the newest a subscriber verifies, is finite. (Behind the intake the
    trainer re-scores every row with its own task, and behind that the step skips an update whose
    gradient norm is not finite: ``test_behind_the_intake_a_non_finite_gradient_norm_skips_the_update``.)"""
    net = Site(tmp_path, "t0", "i0")
    t = Trainer(net, tmp_path / "t0", steps=3)

    async def feed(_: asyncio.Task[Any]) -> None:
        d0 = t.node.digests[0]
        await t.writer.write(batch_rows(0, d0, 0, reward=1e300))
        for b in (1, 2, 3):
            await t.writer.write(batch_rows(0, d0, b))

    await t.run(feed)

    assert [v for v, _ in t.published] == [0, 1, 2, 3] and all(ok for _, ok in t.published), t.published
    assert t.refused == {"reward_range": 1} and t.node.feed.stats.failed_steps == 0
    assert t.grpo.local.steps == 3  # one per honest batch
    assert finite(dict(t.grpo.local.model.named_parameters()))
    version, state = await _subscribe_newest(net)
    assert version == 3 and finite(state)


def test_behind_the_intake_a_non_finite_gradient_norm_skips_the_update() -> None:
    """The last guard, for what the intake and the re-scoring let through: a reward of 1e30 (inside
    the widest range an intake may be configured with) handed straight to the GRPO step makes the
    gradient norm overflow float32 (inf); the update is skipped, the weights and AdamW moments stay
    as they were, and the next honest step trains."""
    grpo = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3, pad_id=BYTE_PAD))
    before = {n: p.detach().clone() for n, p in grpo.local.model.named_parameters()}
    metrics = grpo.step(batch_rows(0, "0" * 64, 0, reward=1e30))
    assert metrics.grad_norm is not None and not math.isfinite(metrics.grad_norm)
    assert grpo.local.skipped == 1 and grpo.local.steps == 0
    assert all(torch.equal(p, before[n]) for n, p in grpo.local.model.named_parameters())
    assert not grpo.local.optimizer.state  # no AdamW moment was touched
    grpo.step(batch_rows(0, "0" * 64, 1))
    assert grpo.local.steps == 1 and finite(dict(grpo.local.model.named_parameters()))
    moments = [v for st in grpo.local.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    assert moments and all(bool(torch.isfinite(m).all()) for m in moments)


async def test_a_token_past_the_vocabulary_is_refused_counted_and_not_taken_after_a_restart(tmp_path: Path) -> None:
    """A batch with a completion token id of 256 (the tiny vocabulary is 0..255) made the GRPO step
    raise IndexError and killed the trainer, which took it again after every restart. Now the node
    refuses it (``token_range``, counted for the node: /status, /metrics) and goes on; a restarted
    node does not take it either."""
    net = Site(tmp_path, "t0", "i0")
    first = Trainer(net, tmp_path / "t0", steps=2)

    async def feed(_: asyncio.Task[Any]) -> None:
        d0 = first.node.digests[0]
        await first.writer.write(batch_rows(0, d0, 0, token=BYTE_VOCAB))  # the hostile batch, seq 0
        for b in (1, 2):
            await first.writer.write(batch_rows(0, d0, b))

    await first.run(feed)
    n = first.node
    assert first.refused == {"token_range": 1} and n.feed.stats.failed_steps == 0
    assert [v for v, _ in first.published] == [0, 1, 2] and n.intake.stats.taken == 2
    assert n.state.rejected["i0"] == {"token_range": 1}  # what /status and /metrics show

    # Restart on the same state dir, one more version to make, one more honest batch to make it from.
    second = Trainer(net, tmp_path / "t0", steps=3)

    async def feed_more(_: asyncio.Task[Any]) -> None:
        await second.writer.write(batch_rows(0, second.node.digests[0], 3))

    await second.run(feed_more)
    m = second.node
    assert m.feed.stats.failed_steps == 0 and m.intake.stats.taken == 1, (m.feed.stats.failed_steps, m.intake.stats.taken)
    assert second.refused == {"token_range": 1}  # looked at again, refused again, never queued
    assert _batches(m.intake.consumed()) == {second.batch_id(b) for b in (1, 2, 3)}  # it trained on the new one
    assert [v for v, _ in second.published] == [3]


class _FailsOnce(GRPOInner):
    """A GRPO step that raises on the first batch it is given (a row the intake's checks let through
    but the step cannot take; none is known, so the fault is injected)."""

    def __init__(self, grpo: GRPOTrainer) -> None:
        super().__init__(grpo)
        self.failed = False

    def step(self, batch: Any) -> Any:
        if not self.failed:
            self.failed = True
            raise RuntimeError("injected: this batch breaks the step")
        return super().step(batch)


async def test_a_batch_whose_step_failed_is_dropped_and_not_taken_after_a_restart(tmp_path: Path) -> None:
    """A step that raises drops its batch (``step_failed``, counted for the node) and the node goes
    on to publish from the next batches; a restarted node does not take that batch again."""
    net = Site(tmp_path, "t0", "i0")
    first = Trainer(net, tmp_path / "t0", steps=2, policy=_FailsOnce)

    async def feed(_: asyncio.Task[Any]) -> None:
        for b in (0, 1, 2):
            await first.writer.write(batch_rows(0, first.node.digests[0], b))

    await first.run(feed)
    n = first.node
    assert n.feed.stats.failed_steps == 1 and first.refused == {"step_failed": 1}
    assert n.state.errors >= 1 and "injected" in (n.state.last_error or "")
    assert [v for v, _ in first.published] == [0, 1, 2]
    assert n.events.events[-1].totals["failed_steps"] == 1  # in the version events
    assert _batches(n.intake.consumed()) == {first.batch_id(b) for b in (0, 1, 2)}  # the failed one too

    second = Trainer(net, tmp_path / "t0", steps=3)

    async def feed_more(_: asyncio.Task[Any]) -> None:
        await second.writer.write(batch_rows(0, second.node.digests[0], 3))

    await second.run(feed_more)
    # It trained on the new batch, not on the one whose step failed (taken first, in sequence order,
    # were it not in the consumed record).
    assert second.node.intake.stats.taken == 1
    assert _batches(second.node.intake.consumed()) == {second.batch_id(b) for b in (0, 1, 2, 3)}
    assert [v for v, _ in second.published] == [3]


async def test_a_batch_whose_step_failed_is_not_taken_by_a_trainer_restarted_at_once(tmp_path: Path) -> None:
    net = Site(tmp_path, "t0", "i0")
    first = Trainer(net, tmp_path / "t0", steps=2, policy=_FailsOnce)
    stop = asyncio.Event()

    async def feed(task: asyncio.Task[Any]) -> None:
        await first.writer.write(batch_rows(0, first.node.digests[0], 0))
        await wait_until(lambda: first.node.feed.stats.failed_steps == 1, 60, "the failed step", task=task)
        stop.set()  # stopped before any round closes after it

    await first.run(feed, stop)
    assert first.node.feed.stats.failed_steps == 1 and [v for v, _ in first.published] == [0]
    second = Trainer(net, tmp_path / "t0", steps=1)

    async def feed_more(task: asyncio.Task[Any]) -> None:
        await second.writer.write(batch_rows(0, second.node.digests[0], 1))
        # wait for the event asserted below (the take), not for a count of polls; a node that ends
        # without it (it trained on the failed batch instead) fails here, saying so
        await wait_until(lambda: second.batch_id(1) in second.node.intake.consumed(), 120, "batch 1 taken", task=task)

    await second.run(feed_more)
    # The failed batch comes first in sequence order: taken (and trained on) unless remembered.
    assert second.batch_id(1) in second.node.intake.consumed(), second.node.intake.consumed()


def _batches(consumed: dict[str, int]) -> set[str]:
    """The batch ids of a consumed record (it also holds the batch ids answered: ``ANSWERED``)."""
    from pulsenet.rollouts.intake import ANSWERED

    return {k for k in consumed if not k.startswith(ANSWERED)}


def test_each_channel_of_an_inference_node_has_its_own_payload_cache(tmp_path: Path) -> None:
    """A subscriber prunes its payload cache: with one ``[inference.subscribe] cache_dir`` shared by
    every channel, one channel's prune could delete a payload another had just downloaded."""
    net = Site(tmp_path, "t0", "t1", "i0")
    node = net.inference_node(
        InferenceConfig(
            id="i0",
            run=RUN,
            state_dir=tmp_path / "i0",
            subscribe=SubscriberConfig(cache_dir=tmp_path / "cache"),
        )
    )
    caches = [s.config.cache_dir for s in node.subscribers]
    assert caches == [tmp_path / "cache" / "policy-0", tmp_path / "cache" / "policy-1"]
    asyncio.run(asyncio.to_thread(node.task.close))
