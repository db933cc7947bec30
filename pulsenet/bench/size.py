"""``pulsenet bench size``: the codec and PULSESync at a model size (issue 37, items 3 and 5).

On one machine, for one fixture size (``bench/fixtures.py``: a random-init model at a published
shape and an update pair at lr 3e-6, built once and cached):

1. **The SHA-256 floor**: one core hashing the model's BF16 values in the process's memory (the
   rate every speed below is compared with, measured in the same run).
2. **Codec speed** in this process, on the weights in its own memory (as a node holds them): encode
   with the base digest known (what a publisher does: it published the base) and without it (a
   cold ``pulsenet patch encode``), and apply + verify (every rebuilt tensor's SHA-256 and the model
   digest) as a running subscriber does, into the memory its previous version frees (judged), and
   into fresh memory (``apply_verify_fresh``: a node's first update after a start, or the CLI),
   each with 1 thread and with every core. Best of ``repeat``.
3. **Memory**: ``pulsenet patch encode`` and ``apply`` as child processes, their peak RSS from the
   kernel (each child's ``VmHWM``: resident pages of every kind, mmapped weights included).
4. **Version latency** (``--e2e``): an embedded SeaweedFS, a ``Publisher`` writing straight to it
   (the trainer beside its store) and ``subscribers`` each pulling through its own link at each
   ``link_mbps``: the chaos link relay (``python -m pulsenet.chaos.link --mbps``, a TCP relay in a
   process of its own, paced each way; run as a program because chaos sits beside bench in the
   layers), so the patch crosses a real socket at that rate, as over a site's link: from
   ``publish()`` of the new state until every subscriber serves it verified. The anchor (v0)
   goes through open links first; a full-checkpoint sync over the same link is its bytes over the
   link rate.

Budgets (issue 37) are checked and written as ``budgets.<name>.pass``. JSON schema: docs/bench.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pulsenet.bench import BenchSettings, config_of
from pulsenet.errors import ConfigError
from pulsenet.nodes.memory import GiB, available_memory, proc_memory

SCHEMA = "pulsenet.bench.size/1"


@dataclass(kw_only=True)
class SizeBenchSettings(BenchSettings):
    """The codec and PULSESync at a model size: SHA-256 floor, encode/apply speed on 1 and all cores,
    CLI peak memory, version latency through a throttled link (docs/scale.md)."""

    params: str = "1B"
    """Fixture size: 135M, 0.35B, 1B or 3B (bench/fixtures.py)."""
    seed: int = 0
    """Fixture seed."""
    method: str = "auto"
    """Pair method: auto, adamw or first-step."""
    steps: int = 0
    """adamw steps of the pair (0: 2 for adamw, so the pair carries Adam moments; 1 for first-step)."""
    threads: int = 0
    """Threads of the all-cores runs (0: this process's cores, capped by OMP_NUM_THREADS)."""
    repeat: int = 2
    """Runs of each in-process speed measurement (the best is kept)."""
    cli: bool = True
    """Run pulsenet patch encode/apply as child processes (peak RSS)."""
    e2e: bool = True
    """Publish/pull through the embedded store and throttled links (version latency)."""
    link_mbps: list[float] = field(default_factory=lambda: [100.0, 1000.0])
    """Link rates of the latency runs (Mbit/s)."""
    latency_repeat: int = 3
    """Patch versions per link rate: each is reported, the budget judges their median (one
    version's latency on a shared VM swings by a few tenths of a second)."""
    warmup: int = 1
    """Versions per link rate before those judged: reported, not judged (a node's first update
    after a start rebuilds into fresh memory; a running node's, into what its old tensors free)."""
    subscribers: int = 1
    """Subscribers (inference nodes) of the latency runs, each with its own link."""
    workdir: Path | None = None
    """Scratch (patches, CLI outputs, the store); None: a temporary directory beside the fixture."""


def run(s: SizeBenchSettings) -> dict:
    from pulsenet.bench.fixtures import PairSpec, build_model_dir, default_dirs, make_pair, resolve_method
    from pulsenet.checkpoint import Checkpoint
    from pulsenet.codec.threads import available_cores, codec_threads

    load0, stolen0 = os.getloadavg(), _stolen_s()
    model_dir, pair_dir = default_dirs(s.params, s.seed)
    build_model_dir(model_dir, params=s.params, seed=s.seed)
    import json

    numel = sum(t.numel() for t in Checkpoint(model_dir).values())
    if s.e2e and (why := e2e_refusal(2 * numel, available_memory())):
        raise ConfigError(why)  # before minutes of fixtures and codec runs, not an OOM kill after them
    method = resolve_method(PairSpec(method=s.method), numel)
    steps = s.steps or (2 if method == "adamw" else 1)
    make_pair(model_dir, pair_dir, PairSpec(method=method, steps=steps, seed=s.seed))
    pair = json.loads((pair_dir / "pair.json").read_text())
    old, new = pair_dir / "old", pair_dir / "new"
    threads = codec_threads(s.threads)
    scratch_parent = pair_dir.parent
    if s.workdir is not None:
        s.workdir.mkdir(parents=True, exist_ok=True)  # as every bench's --workdir: created if missing
    with tempfile.TemporaryDirectory(prefix="size-", dir=s.workdir or scratch_parent) as tmp:
        scratch = Path(tmp)
        speed = measure_codec(old, new, threads, s.repeat, scratch)
        cli = measure_cli(old, new, threads, speed["digests"]["old"], scratch) if s.cli else None
        e2e = asyncio.run(measure_e2e(old, new, s, threads, scratch)) if s.e2e else None
    model_bytes = speed["bytes"]["model_bf16"]
    result = {
        "schema": SCHEMA,
        "config": config_of(s) | {"threads": threads},
        "machine": {
            "load_average_start": list(load0),
            "load_average_end": list(os.getloadavg()),
            "cpu_stolen_s": None if stolen0 is None else _stolen_s() - stolen0,
            "cores_available": available_cores(),
            "threads_used": threads,
            "platform": platform.platform(),
            "processor": _cpu_model(),
            "python": sys.version.split()[0],
        },
        "fixture": {"model": str(model_dir), "pair": pair},
        **{k: v for k, v in speed.items() if k != "digests"},
        "cli": cli,
        "e2e": e2e,
    }
    result["budgets"] = budgets(result, model_bytes, threads)
    _print(result)
    return result


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


E2E_BESIDE = 3 * GiB // 2  # interpreter, torch, numba, the codec's windows: measured peaks less three states


def e2e_refusal(model_bytes: int, available: int | None) -> str | None:
    """Why publish/pull (``--e2e``) cannot run here, or None. It holds three BF16 states in this one
    process (the publisher's base and new state, a subscriber's), the anchor in transit beside them:
    at 3B (5.9 GB) 21.1 GiB at peak, at 1B 9.1 GiB (2026-12-07). Three states and 1.5 GiB is less than
    either, so a run refused here is one the OOM killer would have ended minutes in."""
    need = 3 * model_bytes + E2E_BESIDE
    if available is None or need <= available:
        return None
    return (f"publish/pull holds three {model_bytes / GiB:.1f} GiB BF16 states in one process, at least "
            f"{need / GiB:.1f} GiB, and {available / GiB:.1f} GiB is available: run with --no-e2e, or on a larger machine")


def _stolen_s() -> float | None:
    """CPU seconds the hypervisor has taken from this VM since boot, all CPUs (``steal`` in
    /proc/stat): what a run lost to other guests, so its speeds can be read beside it."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _best(repeat: int, fn):
    """(fastest wall time of ``repeat`` runs, the last result, the fastest run's CPU seconds). On a
    shared machine the fastest run is the least disturbed, and CPU seconds per byte say what the
    work costs whatever share of the cores the other processes left us."""
    best, out, cpu = float("inf"), None, 0.0
    for _ in range(max(1, repeat)):
        out = None
        t, c = time.perf_counter(), time.process_time()
        result = fn()
        wall, used = time.perf_counter() - t, time.process_time() - c
        if wall < best:
            best, cpu = wall, used
        out = result
    return best, out, cpu


def measure_codec(old: Path, new: Path, threads: int, repeat: int, scratch: Path) -> dict:
    """SHA-256 floor, encode and apply+verify speeds (1 thread and ``threads``), on the weights in
    memory as a node holds them (the floor hashes those same tensors): reading the files is the
    CLI's part (``measure_cli``), not the codec's."""
    from pulsenet.bench.e2e import _warm_up_codec
    from pulsenet.codec.buffers import BufferPool
    from pulsenet.codec.digest import model_digest
    from pulsenet.codec.patch import PatchEncoder, iter_apply, parse_patch

    a, b = resident(old), resident(new)
    nbytes = sum(t.numel() * t.element_size() for t in b.values())
    _warm_up_codec()
    t_sha1, _, cpu_sha1 = _best(repeat, lambda: model_digest(b, 1))
    t_shaN, digest_new, _ = _best(repeat, lambda: model_digest(b, threads))
    digest_old = model_digest(a, threads)
    floor = nbytes / t_sha1
    out: dict = {"sha256": {"one_core_GBps": floor / 1e9, "all_threads_GBps": nbytes / t_shaN / 1e9,
                            "one_core_s": t_sha1, "all_threads_s": t_shaN, "one_core_cpu_s": cpu_sha1,
                            "cpu_GBps": nbytes / max(cpu_sha1, 1e-9) / 1e9}}
    rows: dict = {}
    data = b""
    for n in sorted({1, threads}):
        enc = PatchEncoder(threads=n)
        t_warm, data, c_warm = _best(repeat, lambda enc=enc: enc.encode(a, b, base_digest=digest_old))
        t_cold, _, c_cold = _best(1, lambda enc=enc: enc.encode(a, b))

        def apply(n=n, data=data, buffers=None) -> int:
            count = 0
            for _, _t in iter_apply(a, data, base_digest=digest_old, threads=n, buffers=buffers):
                count += 1  # each tensor dropped as the next comes: its memory goes back to ``buffers``
            return count

        # A running subscriber rebuilds into the memory its previous version's tensors free (its
        # BufferPool, warmed by its first update: one untimed apply here); a node's first update
        # after a start and a one-shot ``pulsenet patch apply`` take fresh pages from the kernel.
        pool = BufferPool()
        apply(buffers=pool)
        t_apply, _, c_apply = _best(repeat, lambda pool=pool: apply(buffers=pool))
        t_fresh, _, c_fresh = _best(repeat, apply)
        rows[n] = {"encode_known_base_s": t_warm, "encode_hash_base_s": t_cold, "apply_verify_s": t_apply,
                   "apply_verify_fresh_s": t_fresh, "encode_known_base_cpu": c_warm, "encode_hash_base_cpu": c_cold,
                   "apply_verify_cpu": c_apply, "apply_verify_fresh_cpu": c_fresh}
    (scratch / "step.patch").write_bytes(data)
    p = parse_patch(data)
    if p.target_digest != digest_new:
        raise AssertionError("the patch's target digest is not the new model's")
    one, many = rows[1], rows[threads]
    out["bytes"] = {"model_bf16": nbytes, "patch": len(data), "ratio": nbytes / len(data),
                    "changed_entries": sum(e.nnz for e in p.tensors if e.op == "sparse")}
    out["codec"] = {}
    for key in ("encode_known_base_s", "encode_hash_base_s", "apply_verify_s", "apply_verify_fresh_s"):
        name = key.removesuffix("_s")
        cpu = name + "_cpu"
        out["codec"][name] = {
            "one_thread_s": one[key], "all_threads_s": many[key], "speedup": one[key] / many[key],
            "one_thread_GBps": nbytes / one[key] / 1e9, "all_threads_GBps": nbytes / many[key] / 1e9,
            "ratio_to_sha_floor_one_thread": (nbytes / one[key]) / floor,
            "ratio_to_sha_floor_x_threads": (nbytes / many[key]) / (threads * floor),
            "cpu_s_one_thread": one[cpu], "cpu_s_all_threads": many[cpu],
            "cores_busy_all_threads": many[cpu] / many[key],
            "cpu_ratio_to_sha": cpu_sha1 / max(many[cpu], 1e-9),
        }
    out["digests"] = {"old": digest_old, "new": digest_new}
    return out


def resident(path: Path) -> dict:
    """A model's tensors in memory of the process's own, as a node holds its weights: safetensors
    maps the file, and mapped pages are the page cache's to evict and read back (at 3B, with the
    publisher's two states and a subscriber's in one process, each encode read them back from disk:
    7.8 s where the same encode from memory takes 3.1 s)."""
    from pulsenet.checkpoint import Checkpoint

    return {n: t.clone() for n, t in Checkpoint(path).items()}


def _child(cmd: list[str]) -> dict:
    """Run ``cmd``; its wall time and peak RSS.

    The peak is the child's own ``VmHWM`` (/proc/<pid>/status: the high-water mark of the address
    space it exec'd into), read every 20 ms until it exits. ``wait4``'s ``ru_maxrss`` would not
    do: Linux carries the forking parent's RSS into the child's count across ``execve``.
    """
    peak = 0
    with tempfile.TemporaryFile() as log:  # a file, not a pipe: nothing blocks while we wait
        t = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:  # a zombie has no VmHWM: proc_memory is None then
            peak = max(peak, (proc_memory(proc.pid) or {}).get("peak_rss", 0))
            time.sleep(0.02)
        wall = time.perf_counter() - t
        log.seek(0)
        output = log.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output[-2000:]}")
    return {"wall_s": wall, "peak_rss_bytes": peak, "output": output.strip().splitlines()[-2:]}


def measure_cli(old: Path, new: Path, threads: int, digest_old: str, scratch: Path) -> dict:
    """``pulsenet patch encode`` and ``apply`` as child processes (all threads): wall and peak RSS.
    The wall time includes starting Python and importing torch (~2-4 s)."""
    py = [sys.executable, "-m", "pulsenet"]
    patch, out = scratch / "cli.patch", scratch / "cli-out"
    common = ["--threads", str(threads)]
    res = {
        "encode": _child([*py, "patch", "encode", str(old), str(new), "-o", str(patch), "--level", "1", *common]),
        "encode_known_base": _child([*py, "patch", "encode", str(old), str(new), "-o", str(patch), "--level", "1",
                                     "--base-digest", digest_old, *common]),
        "apply": _child([*py, "patch", "apply", str(old), str(patch), "-o", str(out), *common]),
        "apply_known_base": _child([*py, "patch", "apply", str(old), str(patch), "-o", str(out),
                                    "--base-digest", digest_old, *common]),
    }
    res["startup_s"] = _child([sys.executable, "-c", "import torch, pulsenet.codec.patch"])["wall_s"]
    return res


async def measure_e2e(old: Path, new: Path, s: SizeBenchSettings, threads: int, scratch: Path) -> dict:
    """Publish old (the anchor, links open), then new and old alternately as patches, a session per
    rate in ``link_mbps``: the time from ``publish()`` until every subscriber serves it verified.

    Each session starts fresh subscribers, each reaching the store through its own link relay at
    that rate (``_links``), which resume from the verified weights the previous session persisted
    (``state_dir``) and then take ``warmup`` + ``latency_repeat`` versions, as a running node does:
    only each new version's patch crosses the link. The warm-up versions are reported, not judged:
    a node's first update after a (re)start rebuilds into fresh memory, the next ones into the
    memory its old tensors free (``codec/buffers.py``). The publisher writes straight to the store
    (the trainer beside its bucket; the inference nodes are remote), from weights already in memory
    (a trainer's at the end of its step), not read from disk.
    """
    import resource

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from pulsenet.signing import key_id
    from pulsenet.store import S3Store
    from pulsenet.store.seaweed import SeaweedServer
    from pulsenet.sync import Publisher, PublisherConfig

    key = Ed25519PrivateKey.generate()
    trusted = {key_id(key.public_key()): key.public_key()}
    # In memory, as a trainer's weights are at step end; ``new`` only once the anchor is through:
    # at 3B both states beside the anchor in transit (encoded, joined, fetched) pass 24 GB.
    states: list[dict | None] = [resident(old), None]
    sub_threads = max(1, threads // max(1, s.subscribers))
    rows: list[dict] = []
    with SeaweedServer(scratch / "s3") as server:
        server.create_buckets("bench")
        pub_store = S3Store("bench", "size", server.config())
        pub = Publisher(pub_store, key, PublisherConfig(anchor_every=10**9, keep_anchors=None, threads=threads,
                                                        transfer_timeout_s=3600.0))
        async with pub:
            sessions = [(None, 0, 1)] + [(m, s.warmup, max(1, s.latency_repeat)) for m in s.link_mbps]
            for mbps, warmup, repeat in sessions:
                pull = _Pull(server, s.subscribers, mbps, sub_threads, trusted, scratch)
                async with pull:
                    for i in range(warmup + repeat):
                        version = len(rows)
                        if (state := states[version % 2]) is None:
                            state = states[1] = await asyncio.to_thread(resident, new)
                        row = await pull.version(pub, state, version) | {"warmup": i < warmup}
                        rows.append(row)
                        print(f"v{version} {row['kind']} link {mbps or 'open'}{' (warm-up)' if row['warmup'] else ''}: "
                              f"{sum(row['payload_bytes'].values()) / 1e6:.1f} MB, all verified {row['all_verified_s']:.2f}s",
                              file=sys.stderr)
        await pub_store.close()
    return {"subscribers": s.subscribers, "subscriber_threads": sub_threads, "versions": rows,
            "process_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "note": "publisher and subscribers share this one process (and its cores): the per-node memory "
                    "figures are the CLI's"}


class _Pull:
    """One session of ``n`` subscribers, each through its own link at ``mbps`` (None: open)."""

    def __init__(self, server, n: int, mbps: float | None, sub_threads: int, trusted, scratch: Path) -> None:
        self.server, self.n, self.mbps, self.sub_threads, self.trusted = server, n, mbps, sub_threads, trusted
        self.scratch = scratch
        self.verified: dict[tuple[int, int], float] = {}
        self.saved: set[tuple[int, int]] = set()
        self.cond = asyncio.Condition()
        self.stop = asyncio.Event()
        self.links: list[tuple[str | None, subprocess.Popen | None]] = []
        self.stores: list = []
        self.subs: list = []
        self.tasks: list[asyncio.Task] = []

    def _hooks(self, i: int):
        async def on_update(v: int, _state, _digest: str) -> None:
            self.verified[(i, v)] = time.perf_counter()
            async with self.cond:
                self.cond.notify_all()

        def on_saved(v: int, _digest: str) -> None:
            self.saved.add((i, v))

        return on_update, on_saved

    async def until(self, pred) -> None:
        while not pred():
            async with self.cond:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.cond.wait(), 0.2)  # on_saved runs in a thread: poll too

    async def __aenter__(self) -> _Pull:
        from pulsenet.store import S3Store
        from pulsenet.sync import Subscriber, SubscriberConfig

        self.links = _links(self.n, self.server.config("reader").endpoint_url, self.mbps, self.scratch)
        self.stores = [S3Store("bench", "size", dataclasses.replace(self.server.config("reader"), endpoint_url=url))
                       for url, _ in self.links]
        for i, st in enumerate(self.stores):
            on_update, on_saved = self._hooks(i)
            cfg = SubscriberConfig(interval_s=0.05, jitter=0.2, threads=self.sub_threads, transfer_timeout_s=3600.0,
                                   state_dir=self.scratch / f"sub{i}" / "state", cache_dir=self.scratch / f"sub{i}" / "cache")
            self.subs.append(Subscriber(st, self.trusted, cfg, on_update=on_update, on_saved=on_saved))
        for sub in self.subs:
            await sub.start()  # resume the previous session's version from disk, outside the measurement
        self.tasks = [asyncio.create_task(sub.run(self.stop)) for sub in self.subs]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for sub, st in zip(self.subs, self.stores, strict=True):
            await sub.close()
            await st.close()
        for _, proc in self.links:
            if proc is not None:
                proc.terminate()
                await asyncio.to_thread(proc.wait, 10)
        # Each subscriber's hooks close over this session, so the two form a cycle that only the
        # cyclic GC would free, whenever it ran: the next session's subscribers then loaded their
        # state beside this one's (at 3B a fourth 5.9 GB state, and the OOM killer took the bench).
        self.subs.clear()
        self.tasks.clear()
        self.stores.clear()

    async def version(self, pub, state, version: int) -> dict:
        """Publish ``state`` as ``version``; its row once every subscriber serves and persisted it."""
        n = self.n
        if version:  # resumed from disk, or taken (and persisted: ``version`` waits for that) here
            await self.until(lambda: all(sub.version == version - 1 for sub in self.subs))
        await asyncio.to_thread(os.sync)  # the last version's 2 GB state files written back before t0, not during
        for task in self.tasks:
            if task.done():
                task.result()  # a subscriber that died says why
        t0 = time.perf_counter()
        pub.publish(state, step=version)
        await self.until(lambda: all((i, version) in self.verified for i in range(n)))
        latency = max(self.verified[(i, version)] for i in range(n)) - t0
        await self.until(lambda: all((i, version) in self.saved for i in range(n)))
        rec = pub.records[-1]
        mbps = self.mbps
        row = {"version": version, "kind": rec.kind, "link_mbps": mbps,
               "link": "open" if mbps is None else "chaos link relay (python -m pulsenet.chaos.link --mbps), one per subscriber",
               "payload_bytes": rec.payload_bytes,
               "full_bytes": rec.full_bytes, "encode_s": rec.encode_s, "upload_s": rec.upload_s,
               "published_s": rec.latency_s, "all_verified_s": latency,
               "subscriber_download_s": [sub.stats.last_download_s for sub in self.subs],
               "subscriber_apply_s": [sub.stats.last_apply_s for sub in self.subs]}
        if mbps is not None:
            link_s = rec.payload_bytes["patch"] * 8 / (mbps * 1e6)
            row |= {"link_time_s": link_s, "budget_s": 1.25 * link_s + 2.0,
                    "full_checkpoint_link_time_s": rec.full_bytes * 8 / (mbps * 1e6)}
            row["pass"] = latency <= row["budget_s"]
        return row


def _links(n: int, endpoint: str | None, mbps: float | None, scratch: Path) -> list[tuple[str | None, subprocess.Popen | None]]:
    """``n`` links to the store at ``endpoint``: (URL to reach it by, the relay's process). Open
    links (``mbps`` None) are the endpoint itself; others each a chaos link relay paced to ``mbps``
    (``python -m pulsenet.chaos.link``; its first line names the address it took), tied to this
    process so that none outlives it, its output in ``scratch``."""
    from pulsenet.runtime import spawn_tied

    if mbps is None:
        return [(endpoint, None)] * n
    upstream = urlsplit(endpoint or "").netloc
    out: list[tuple[str | None, subprocess.Popen | None]] = []
    for i in range(n):
        cmd = [sys.executable, "-m", "pulsenet.chaos.link", "--listen", "127.0.0.1:0", "--upstream", upstream,
               "--mbps", f"{mbps:g}"]
        log = scratch / f"link-{i}.log"
        with log.open("wb") as f:
            proc = spawn_tied(cmd, f"bench-link-{i}", stdout=f, stderr=subprocess.STDOUT)
        out.append((None, proc))
        deadline = time.monotonic() + 60
        while not (line := _first_line(log)).startswith("link: "):
            if proc.poll() is not None or time.monotonic() > deadline:
                for _, p in out:
                    assert p is not None
                    p.kill()
                raise RuntimeError(f"the link relay did not start: {log.read_text(errors='replace')[-500:]!r}")
            time.sleep(0.05)
        out[-1] = (f"http://{line.split()[1]}", proc)  # link: 127.0.0.1:PORT -> ...
    return out


def _first_line(path: Path) -> str:
    """``path``'s first line once it is whole, else ""."""
    text = path.read_text(errors="replace")
    return text.partition("\n")[0] if "\n" in text else ""


def budgets(r: dict, model_bytes: int, threads: int) -> dict:
    """Issue 37's budgets, each with its measured value, its limit and pass/fail."""
    out: dict = {}
    mem_limit = 2 * model_bytes + GiB
    if r["cli"]:
        for k in ("encode", "encode_known_base", "apply", "apply_known_base"):
            v = r["cli"][k]["peak_rss_bytes"]
            out[f"memory_cli_{k}"] = {"value": v, "limit": mem_limit, "pass": v <= mem_limit}
    for k in ("encode_known_base", "apply_verify"):
        c = r["codec"][k]
        if threads > 1:
            out[f"speedup_{k}"] = {"value": c["speedup"], "limit": 1.6, "pass": c["speedup"] >= 1.6}
        out[f"rate_{k}"] = {"value": c["ratio_to_sha_floor_x_threads"], "limit": 0.5,
                            "pass": c["ratio_to_sha_floor_x_threads"] >= 0.5,
                            "what": "all-threads rate / (threads x one core's SHA-256 rate)"}
    if r["e2e"]:
        for mbps in sorted({v["link_mbps"] for v in r["e2e"]["versions"] if v["link_mbps"] is not None}):
            rows = [v for v in r["e2e"]["versions"] if v["link_mbps"] == mbps and not v.get("warmup")]
            value, limit = (statistics.median(v[k] for v in rows) for k in ("all_verified_s", "budget_s"))
            out[f"latency_{mbps:g}mbps"] = {"value": value, "limit": limit, "pass": value <= limit,
                                             "what": f"median of {len(rows)} versions",
                                             "each": [v["all_verified_s"] for v in rows]}
    return out


def _print(r: dict) -> None:
    gb = r["bytes"]["model_bf16"] / 1e9
    print(f"{r['config']['params']}: {gb:.2f} GB BF16, patch {r['bytes']['patch'] / 1e6:.2f} MB "
          f"({r['fixture']['pair']['changed_fraction'] * 100:.2f}% changed, {r['fixture']['pair']['method']}); "
          f"SHA-256 one core {r['sha256']['one_core_GBps']:.2f} GB/s; load {r['machine']['load_average_start'][0]:.1f}")
    for k, c in r["codec"].items():
        print(f"  {k:18s} 1 thread {c['one_thread_s']:.2f}s, {r['machine']['threads_used']} threads "
              f"{c['all_threads_s']:.2f}s (x{c['speedup']:.2f}; {c['ratio_to_sha_floor_x_threads']:.2f} of the floor; "
              f"{c['cores_busy_all_threads']:.2f} cores busy; CPU cost {1 / c['cpu_ratio_to_sha']:.2f} x SHA-256's)")
    for name, b in r["budgets"].items():
        print(f"  budget {name}: {b['value']:.4g} vs {b['limit']:.4g}: {'pass' if b['pass'] else 'FAIL'}")
