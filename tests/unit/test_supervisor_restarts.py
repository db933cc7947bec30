"""A restarted node, in process: an inference node restarted with the same config and state directory
serves its saved version at once but generates nothing from a version older than the newest it can
verify at start (issue 24, defect 3: a restarted node generated 9 batches at v52 while the trainers
were at v61, all discarded as stale)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from pulsenet.nodes.build import compose_inference
from pulsenet.nodes.common import text_codec
from pulsenet.nodes.config import InferenceConfig
from pulsenet.nodes.events import read_events
from pulsenet.nodes.inference import InferenceNode
from pulsenet.rl.models import bf16_state_dict, build_tiny_model
from pulsenet.rl.tasks import TaskConfig, build_task
from pulsenet.signing import generate_keypair, key_id, load_private_key, load_public_key
from pulsenet.store import LocalStore
from pulsenet.sync.publisher import Publisher, PublisherConfig
from pulsenet.sync.subscriber import SubscriberConfig
from tests.support.sync_support import perturbed_states
from tests.support.waiting import wait_until

RUN = "restart"
MANIFEST = re.compile(r"manifests/v(\d{12})-i0-\d{8}\.json$")


def _batches(root: Path) -> dict[str, int]:
    """Every rollout batch of i0 still in its store (retention deletes old ones): manifest -> version."""
    return {p.name: int(m.group(1)) for p in root.rglob("*.json") if (m := MANIFEST.search(p.as_posix()))}


@pytest.mark.timeout(120)
async def test_a_restarted_inference_node_generates_nothing_older_than_what_it_can_verify(tmp_path: Path) -> None:
    for site in ("t0", "i0"):
        generate_keypair(tmp_path / "keys" / f"{site}.key")
    t_key, t_pub = load_private_key(tmp_path / "keys" / "t0.key"), load_public_key(tmp_path / "keys" / "t0.key.pub")
    states = perturbed_states(bf16_state_dict(build_tiny_model(0)), 5, fraction=0.01)
    channel, rollouts = tmp_path / "s3" / "t0", tmp_path / "s3" / "i0"
    state_dir = tmp_path / "state" / "i0"

    def node() -> InferenceNode:  # the same command, config and state directory every life
        return compose_inference(
            InferenceConfig(
                id="i0",
                run=RUN,
                prompts=4,
                group_size=2,
                task=TaskConfig(max_new_tokens=3),
                batches_per_version=2,
                state_dir=state_dir,
                subscribe=SubscriberConfig(interval_s=0.2),
                status_every_s=1.0,
            ),
            store=LocalStore(rollouts),
            policy_stores=[LocalStore(channel)],
            trusted={key_id(t_pub): t_pub},
            key=load_private_key(tmp_path / "keys" / "i0.key"),
            task=build_task("arith", seed=0),
            text=text_codec("tiny"),
        )

    async with Publisher(LocalStore(channel), t_key, PublisherConfig(run=RUN, anchor_every=100)) as pub:
        for v in range(2):
            await pub.publish_now(states[v])

        # First life: follows the channel to v1 and generates there, then stops (as a SIGTERM would).
        first, stop = node(), asyncio.Event()
        task = asyncio.create_task(first.run(stop))
        await wait_until(lambda: 1 in _batches(rollouts).values(), 60, "a batch at v1")
        stop.set()
        await task
        before = _batches(rollouts)
        assert max(before.values()) == 1

        # While it is down the trainers move on to v4.
        for v in range(2, 5):
            await pub.publish_now(states[v])

        # Second life: it resumes v1 from disk (served at once: the only weights it has), but the
        # first batch it writes is at v4, the newest version it could verify when it started.
        second, stop = node(), asyncio.Event()
        task = asyncio.create_task(second.run(stop))
        await wait_until(lambda: set(_batches(rollouts)) - set(before), 60, "a batch after the restart")
        stop.set()
        await task

    after = {name: v for name, v in _batches(rollouts).items() if name not in before}
    assert after and set(after.values()) == {4}, after
    served = [e.version for e in read_events(state_dir / "events.jsonl") if e.kind == "served"]
    assert served[-2:] == [1, 4], served  # resumed v1 (served, never generated from), then caught up to v4
    assert second.state.degraded is None  # "catching up" cleared once it did


def test_a_trainer_node_spools_payloads_in_its_own_directory_emptied_at_start(tmp_path: Path) -> None:
    """A payload spooled for upload (an anchor: the model's size) that a killed trainer left behind
    goes at the next start; a spool directory the user set is theirs and is never emptied."""
    from pulsenet.nodes.build import _spooling
    from pulsenet.nodes.config import TrainerConfig

    left = tmp_path / "state" / "spool" / "pulsenet-payload-killed"
    left.parent.mkdir(parents=True)
    left.write_bytes(b"x" * 1024)
    cfg = _spooling(TrainerConfig(state_dir=tmp_path / "state"))
    assert cfg.spool_dir == tmp_path / "state" / "spool" and cfg.spool_dir.is_dir() and not left.exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "keep").write_bytes(b"y")
    given = _spooling(TrainerConfig(state_dir=tmp_path / "state", publish=PublisherConfig(spool_dir=theirs)))
    assert given.spool_dir == theirs and (theirs / "keep").exists()
