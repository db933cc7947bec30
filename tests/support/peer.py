"""A test network of real nodes on ``LocalStore``s with the tiny model, and a peer holding a key they
trust (the signed-peer tests, tests/unit/test_signed_peer.py, and the hostile-node tests)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pulsenet.codec.rollout import Rollout
from pulsenet.nodes.build import compose_inference, compose_trainer
from pulsenet.nodes.common import text_codec
from pulsenet.nodes.config import InferenceConfig, TrainerConfig
from pulsenet.nodes.inference import InferenceNode
from pulsenet.nodes.rounds import finite
from pulsenet.rl.grpo import GRPOConfig, GRPOTrainer
from pulsenet.rl.inner import GRPOInner
from pulsenet.rl.models import BYTE_PAD, build_tiny_model
from pulsenet.rl.replay import ReplayConfig
from pulsenet.rl.tasks import assign_problems, build_task, group_id
from pulsenet.rollouts import RolloutIntakeConfig, RolloutSource, RolloutWriter, RolloutWriterConfig
from pulsenet.rollouts.layout import BatchName
from pulsenet.signing import generate_keypair, key_id, load_private_key, load_public_key
from pulsenet.store import LocalStore
from tests.support.waiting import wait_until

RUN = "signed-peer"


class Site:
    """Keys and stores of one test network (every site's bucket a LocalStore under tmp)."""

    def __init__(self, tmp: Path, *sites: str) -> None:
        self.tmp = tmp
        self.keys, self.pubs = {}, {}
        for s in sites:
            generate_keypair(tmp / "keys" / f"{s}.key")
            self.keys[s] = load_private_key(tmp / "keys" / f"{s}.key")
            self.pubs[s] = load_public_key(tmp / "keys" / f"{s}.key.pub")

    def store(self, site: str) -> LocalStore:
        return LocalStore(self.tmp / "s3" / site)

    def trusted(self, *sites: str) -> dict:
        return {key_id(self.pubs[s]): self.pubs[s] for s in sites}

    def inference_node(self, config: InferenceConfig) -> InferenceNode:
        """Node i0 (its own bucket and key) following t0's and t1's channels, on the arith task."""
        return compose_inference(
            config,
            store=self.store("i0"),
            policy_stores=[self.store("t0"), self.store("t1")],
            trusted=self.trusted("t0", "t1"),
            key=self.keys["i0"],
            task=build_task("arith", seed=0),
            text=text_codec("tiny"),
        )


async def stop_node(stop: asyncio.Event, task: asyncio.Task[Any]) -> None:
    """Stop the node; anything it raised surfaces here. One that does not stop within a minute is
    cancelled and fails the test."""
    stop.set()
    done, _ = await asyncio.wait({task}, timeout=60)
    if not done:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise AssertionError("the node did not stop within 60 s of its stop event")
    await task


TASK = "arith"
"""The task both sides run: the trainer re-scores every row against it (``rl/rescore.py``)."""


def batch_rows(version: int, digest: str, batch: int, *, reward: float | None = None, token: int | None = None) -> list[Rollout]:
    """Batch ``batch`` of node i0 at ``version`` as an honest node makes it: 2 of the task's
    assigned problems with their prompts and group ids, 4 completions each (2 right answers, 2
    wrong), each claiming the reward the task gives it. ``reward``: claimed by the first row
    instead; ``token``: a completion id put in the first row (e.g. one past the vocabulary)."""
    task, text = build_task(TASK, seed=0), text_codec("tiny")
    try:
        prompter = task.prompter(text)
        problems = assign_problems(task, node="i0", version=version, seed=0, n=2, batch=batch)
        rows = []
        for k, p in enumerate(problems):
            prompt = prompter.encode(p.prompt)
            assert prompt is not None
            for i in range(4):
                answer = f"{p.answer}\n" if i % 2 == 0 else "x\n"
                ids = list(answer.encode())
                if token is not None and k == i == 0:
                    ids[0] = token
                truth = task.score_texts([p], [prompter.completion_text(ids)]).total[0]
                rows.append(Rollout(
                    group=group_id("i0", version, batch, k), prompt_ids=tuple(prompt), completion_ids=tuple(ids),
                    logprobs=tuple(-1.5 for _ in ids), reward=reward if reward is not None and k == i == 0 else truth,
                    version=version, model_digest=digest, node="i0", seed=i,
                ))  # fmt: skip
        return rows
    finally:
        task.close()


class Trainer:
    """A lone trainer node on the tiny model with one inference source, and the peer (i0's key)
    that writes signed batches to that source. ``policy``: a ``GRPOInner`` of ``self.grpo``."""

    def __init__(
        self,
        net: Site,
        state_dir: Path,
        steps: int,
        *,
        policy: Callable[[GRPOTrainer], GRPOInner] = GRPOInner,
        replay: bool = False,
        nodes: tuple[str, ...] = ("i0",),
    ) -> None:
        """``replay``: replay rows before training (rl/replay.py); off by default here, because
        ``batch_rows`` writes completions by hand (not the policy's draw) to reach the check under test.
        ``nodes``: the inference sources (each its own bucket and key in ``net``); ``writer`` is i0's."""
        self.grpo = GRPOTrainer(build_tiny_model(0), GRPOConfig(lr=1e-3, pad_id=BYTE_PAD))
        self.node = compose_trainer(
            TrainerConfig(
                id="t0",
                run=RUN,
                steps=steps,
                rows_per_step=8,  # one batch per step
                prompts_per_batch=2,  # what ``batch_rows`` and the tests' nodes answer
                state_dir=state_dir,
                intake=RolloutIntakeConfig(interval_s=0.1, max_staleness=3, group_size=4),  # ``batch_rows``' G
                replay=ReplayConfig(enabled=replay),
            ),
            store=net.store("t0"),
            key=net.keys["t0"],
            sources=[RolloutSource(n, net.store(n), net.trusted(n)) for n in nodes],
            policy=policy(self.grpo),
            task=build_task(TASK, seed=0),
            text=text_codec("tiny"),
        )
        self.published: list[tuple[int, bool]] = []
        """(version, every weight finite) of each state handed to the publisher."""
        publish = self.node.publisher.publish_now

        async def spy(state: Any, *, step: int | None = None) -> Any:
            record = await publish(state, step=step)
            self.published.append((record.version, finite(state)))
            return record

        self.node.publisher.publish_now = spy  # type: ignore[method-assign]
        self.writer = RolloutWriter(net.store("i0"), net.keys["i0"], "i0", RolloutWriterConfig(run=RUN, max_staleness=3))

    def batch_id(self, seq: int) -> str:
        """The intake's id of i0's batch ``seq`` at v0 (what the consumed record holds)."""
        return self.node.intake.batch_id("i0", BatchName(0, "i0", seq))

    @property
    def refused(self) -> dict[str, int]:
        """Reason -> i0's batches the intake refused (or whose step failed: ``step_failed``)."""
        return self.node.intake.stats.rejected_by_node.get("i0", {})

    async def run(self, body: Callable[[asyncio.Task[Any]], Awaitable[None]], stop: asyncio.Event | None = None) -> None:
        """Run the node until it has published its ``steps`` versions (or ``stop``), with ``body``
        feeding it."""
        task = asyncio.create_task(self.node.run(stop or asyncio.Event()))
        try:
            await wait_until(lambda: 0 in self.node.digests, 60, "v0", task=task)
            await body(task)
            try:
                async with asyncio.timeout(90):  # seconds of work on the tiny model
                    await task
            except TimeoutError:
                n = self.node
                raise AssertionError(
                    f"the node did not finish its {n.config.steps} versions: published {self.published}, "
                    f"failed steps {n.feed.stats.failed_steps}, skipped updates {self.grpo.local.skipped}, "
                    f"refused {self.refused}, "
                    f"last error {n.state.last_error}"
                ) from None
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

