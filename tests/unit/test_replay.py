"""The public draw (rl/draw.py) and the trainer's replay of rows (rl/replay.py), on the torch engine.

Honest rows, sampled by a TorchEngine serving a version's BF16 weights with the public draw, pass
the replay a trainer makes in its own forward; each way of cheating refuses the batch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence

import pytest
import torch

from pulsenet.codec.digest import model_digest
from pulsenet.codec.rollout import Rollout, decode_columns, encode_batch
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.errors import ConfigError, RolloutRowError
from pulsenet.nodes.feed import ReplayRows
from pulsenet.rl.draw import DOMAIN, DrawId, choose, seed_key, uniform
from pulsenet.rl.models import bf16_state_dict, build_tiny_model
from pulsenet.rl.replay import ReplayConfig, Replayer, ReplayRow, Tolerances
from pulsenet.rl.sampling import SamplingParams
from pulsenet.rl.tasks import group_id
from pulsenet.rollouts import RolloutBatch
from pulsenet.rollouts.manifest import BatchManifest
from pulsenet.signed import ObjectRef

G = 4
PROMPTS = 8


@pytest.fixture(scope="module")
def policy() -> tuple[torch.nn.Module, dict[str, torch.Tensor], str]:
    model = build_tiny_model(0)
    with torch.no_grad():  # a peakier policy than random init: a few likely tokens per position, as trained ones have
        model.model.embed_tokens.weight.mul_(4.0)
    state = bf16_state_dict(model)
    return model, state, model_digest(state)


def _keys(digest: str, node: str = "i0", version: int = 0, batch: int = 0) -> tuple[bytes, ...]:
    return tuple(DrawId("run", digest, node, version, batch, k, i).key() for k in range(PROMPTS) for i in range(G))


def _prompts() -> list[list[int]]:
    return [[1 + k, 2, 3 + 2 * k] for k in range(PROMPTS) for _ in range(G)]


def _params(**kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "max_new_tokens": 16, "stop_token_ids": (0,), **kw})  # type: ignore[arg-type]


def _sample(state: dict[str, torch.Tensor], digest: str, params: SamplingParams, config: object) -> list[ReplayRow]:
    engine = TorchEngine.from_state(config, state, digest, version=0)  # type: ignore[arg-type]
    gens = engine.generate(_prompts(), params)
    keys = params.draws or _keys(digest)
    return [ReplayRow(g.prompt_ids, g.completion_ids, g.logprobs, k) for g, k in zip(gens, keys, strict=True)]


def _replayer(model: torch.nn.Module, state: dict[str, torch.Tensor], **kw: object) -> Replayer:
    r = Replayer(model.config, _params(), ReplayConfig(**kw), keep=3)  # type: ignore[arg-type]
    r.remember(0, state)
    return r


@pytest.fixture(scope="module")
def honest(policy: tuple) -> list[ReplayRow]:
    model, state, digest = policy
    return _sample(state, digest, _params(draws=_keys(digest)), model.config)


ALL = range(PROMPTS * G)


def test_the_draw_key_and_uniform_are_the_documented_functions() -> None:
    """The rule of docs/format.md, recomputed from its text, and its golden vector."""
    d = DrawId("run", "ab" * 32, "i0", 3, 1, 2, 0)
    fields = json.dumps(["run", "ab" * 32, "i0", 3, 1, 2, 0], separators=(",", ":")).encode()
    assert d.key() == hashlib.sha256(DOMAIN + fields).digest()
    h = hashlib.sha256(d.key() + (5).to_bytes(8, "little")).digest()
    assert uniform(d.key(), 5) == (int.from_bytes(h[:8], "little") >> 11) / 2**53
    assert d.key().hex() == "fc3eda8572771e5fba0418b1baf7bb58998e647cfd66f0d3eb6393bedb22feea"  # docs/format.md
    assert (uniform(d.key(), 0), uniform(d.key(), 5)) == (0.22406950523685154, 0.3235959936078123)


def test_choose_is_inverse_cdf_in_token_id_order() -> None:
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert [int(choose(logits, [u], 1.0, 1.0)) for u in (0.05, 0.1, 0.29, 0.31, 0.61, 0.99)] == [0, 1, 1, 2, 3, 3]
    # top-p 0.5 keeps the two most likely (0.4, 0.3): renormalised over {2, 3} in id order
    assert [int(choose(logits, [u], 1.0, 0.5)) for u in (0.1, 0.5, 0.9)] == [2, 3, 3]
    assert int(choose(logits, [0.0], 0.0, 1.0)) == 3  # greedy draws nothing


def test_the_engine_draws_with_the_keys_it_is_given(policy: tuple) -> None:
    """Same keys, same completions, whatever the batch holds; other keys, other completions."""
    model, state, digest = policy
    engine = TorchEngine.from_state(model.config, state, digest, version=0)
    keys = _keys(digest)
    full = engine.generate(_prompts(), _params(draws=keys))
    alone = engine.generate(_prompts()[5:6], _params(draws=keys[5:6]))
    assert alone[0].completion_ids == full[5].completion_ids
    other = engine.generate(_prompts(), _params(draws=_keys(digest, batch=1)))
    assert [g.completion_ids for g in other] != [g.completion_ids for g in full]
    seeded = engine.generate(_prompts()[:2], _params(seed=7))
    assert seeded[1].completion_ids == engine.generate(_prompts()[1:2], _params(draws=(seed_key(8),)))[0].completion_ids


def test_honest_rows_pass_replay_with_their_margins(policy: tuple, honest: list[ReplayRow]) -> None:
    model, state, _ = policy
    v = _replayer(model, state).check(0, honest, picked=ALL)
    assert v.ok, v.detail
    assert v.margins.numel() == sum(len(r.completion_ids) for r in honest)
    assert float(v.margins.min()) > 0 and float(v.logprob_diffs.max()) < 1e-3


@pytest.mark.parametrize(
    "cheat, reason",
    [
        ("halved_logprobs", "replay_logprob"),
        ("chosen_completions", "replay_token"),
        ("other_temperature", "replay_token"),
        ("perturbed_layer", "replay_token"),
        ("copied_batch", "replay_token"),
        ("cut_short", "replay_params"),
        ("past_stop", "replay_params"),
    ],
)
def test_each_cheat_is_refused(policy: tuple, honest: list[ReplayRow], cheat: str, reason: str) -> None:
    """Every cheat touches every row; the trainer replays a sample of 8 and refuses the batch."""
    model, state, digest = policy
    rows = honest
    if cheat == "halved_logprobs":
        rows = [dataclasses.replace(r, logprobs=tuple(x / 2 for x in r.logprobs)) for r in honest]
    elif cheat == "chosen_completions":  # the policy's own samples, but not the public draw's
        rows = [
            dataclasses.replace(r, key=k)
            for r, k in zip(_sample(state, digest, _params(seed=99), model.config), _keys(digest), strict=True)
        ]
    elif cheat == "other_temperature":  # drawn at T = 0.7, log-probs honest at T = 1
        hot = _sample(state, digest, _params(draws=_keys(digest), temperature=0.7), model.config)
        rows = [
            dataclasses.replace(
                r, logprobs=tuple(TorchEngine.from_state(model.config, state, digest).score(r.prompt_ids, r.completion_ids))
            )
            for r in hot
        ]
    elif cheat == "perturbed_layer":
        bad = {n: (t.float() * 1.05).to(t.dtype) if n == "model.norm.weight" else t for n, t in state.items()}
        engine = TorchEngine(model.__class__(model.config), TorchEngineConfig(verify_updates=False))
        engine.update(0, bad, digest)  # serves other weights under the version's digest
        gens = engine.generate(_prompts(), _params(draws=_keys(digest)))
        rows = [ReplayRow(g.prompt_ids, g.completion_ids, g.logprobs, k) for g, k in zip(gens, _keys(digest), strict=True)]
    elif cheat == "copied_batch":  # node i1's batch, presented as i0's
        rows = [
            dataclasses.replace(r, key=k)
            for r, k in zip(
                _sample(state, digest, _params(draws=_keys(digest, node="i1")), model.config), _keys(digest), strict=True
            )
        ]
    elif cheat == "cut_short":  # completions cut before their stop token, to keep a prefix that pays
        rows = [dataclasses.replace(r, completion_ids=r.completion_ids[:1], logprobs=r.logprobs[:1]) for r in honest]
    elif cheat == "past_stop":
        rows = [dataclasses.replace(r, completion_ids=(0, *r.completion_ids), logprobs=(-1.0, *r.logprobs)) for r in honest]
    v = _replayer(model, state).check(0, rows)
    assert v.reason == reason, (v.reason, v.detail)
    assert len(v.rows) == 12  # the default share (0.375) of 32


def test_a_cheat_on_every_row_is_caught_whatever_rows_are_drawn(policy: tuple, honest: list[ReplayRow]) -> None:
    """The trainer draws the rows it replays after the batch is committed: 20 draws, 20 refusals."""
    model, state, _ = policy
    rows = [dataclasses.replace(r, logprobs=tuple(x / 2 for x in r.logprobs)) for r in honest]
    r = _replayer(model, state)
    assert all(r.check(0, rows).reason == "replay_logprob" for _ in range(20))
    assert r.stats.refused == {"replay_logprob": 20}


def test_replay_config_refuses_nonsense() -> None:
    for bad in (
        {"share": 0.0}, {"share": 1.5}, {"min_rows": 0}, {"cdf_tolerance": 0.6}, {"logprob_tolerance": -1.0}, {"top_p": 0.0}
    ):
        with pytest.raises(ConfigError):
            ReplayConfig(**bad)  # type: ignore[arg-type]


def test_tolerances_are_per_engine_and_dtype_and_unmeasured_ones_must_be_set() -> None:
    """Issue 38: the CDF window is what a node may shift a token within, so it is the measured noise
    of the engine the operator says a node runs (FP32 on CPU: 1e-5 torch, 2e-5 vLLM), not 1e-3."""
    c = ReplayConfig(engines=["i1=vllm:float32"])
    assert c.tolerances() == c.tolerances("i0") == Tolerances(cdf=1e-5, logprob=5e-3, mean_logprob=1e-3)
    assert c.tolerances("i1").cdf == 2e-5
    assert ReplayConfig(engine="torch").tolerances().cdf == 1e-5  # the dtype defaults to float32
    assert ReplayConfig(cdf_tolerance=1e-4).tolerances().cdf == 1e-4  # a setting wins for every engine
    with pytest.raises(ConfigError, match="no measured tolerances"):
        ReplayConfig(engine="vllm:bfloat16")  # BF16: not measured where it runs; the operator sets them
    with pytest.raises(ConfigError, match="NODE=ENGINE"):
        ReplayConfig(engines=["vllm:float32"])
    loose = ReplayConfig(engine="vllm:bf16", cdf_tolerance=0.05, logprob_tolerance=0.3, mean_logprob_tolerance=0.05)
    assert loose.tolerances() == Tolerances(cdf=0.05, logprob=0.3, mean_logprob=0.05)


def test_a_new_node_and_a_struck_node_are_replayed_in_full(policy: tuple, honest: list[ReplayRow]) -> None:
    """Issue 38, sparse cheats: a node's first ``probation_batches`` batches, and every batch of a
    node with a strike, replay every row; otherwise the share (12 of 32)."""
    model, state, _ = policy
    r = _replayer(model, state)
    sizes = [len(r.check(0, honest, node="i1").rows) for _ in range(5)]
    assert sizes == [32, 32, 32, 32, 12]
    assert len(r.check(0, honest, node="i1", strikes=1).rows) == 32
    assert len(r.check(0, honest).rows) == 12  # no node named: the share
    assert r.stats.full == 5 and r.stats.batches_by_node == {"i1": 6}


def test_only_the_last_versions_are_held(policy: tuple) -> None:
    model, state, _ = policy
    r = _replayer(model, state)
    for v in (1, 2, 3):
        r.remember(v, state)
    assert not r.holds(0) and all(r.holds(v) for v in (1, 2, 3))


def test_a_stop_string_before_the_last_token_is_refused(policy: tuple) -> None:
    """With stop strings the completion must end at the first one: text past it is the node's."""
    model, state, _ = policy
    params = _params(stop=("\n",))
    r = Replayer(model.config, params, ReplayConfig(), keep=1, stopped=lambda ids: "\n" in bytes(ids).decode(errors="replace"))
    r.remember(0, state)
    row = ReplayRow((1, 2, 3), tuple(b"12\n34"), (-1.0,) * 5, b"k" * 32)
    assert r.check(0, [row], picked=[0]).reason == "replay_params"
    ends = ReplayRow((1, 2, 3), tuple(b"12\n"), (-1.0,) * 3, b"k" * 32)
    assert r._params_broken(ends) is None


def test_a_batch_is_keyed_as_its_node_drew_it_and_replay_reads_only_the_rows_it_picks(
    policy: tuple, honest: list[ReplayRow]
) -> None:
    """``nodes.feed.ReplayRows`` on a decoded batch whose groups interleave: the i-th row of a
    group is completion i, keyed as the node drew it; ``Replayer.check`` reads the rows it picked
    and no other (a trainer's rows are made, and keyed, on demand)."""
    model, state, digest = policy
    order = [k * G + i for i in range(G) for k in range(PROMPTS)]  # row i of every group, then i + 1
    rollouts = [
        Rollout(group=group_id("i0", 0, 0, j // G), prompt_ids=honest[j].prompt_ids, completion_ids=honest[j].completion_ids,
                logprobs=honest[j].logprobs, reward=0.0, version=0, model_digest=digest, node="i0", seed=0)
        for j in order
    ]  # fmt: skip
    cols = decode_columns(encode_batch(rollouts))
    manifest = BatchManifest(node="i0", seq=1, version=0, model_digest=digest, payload=ObjectRef("b", 1, "0" * 64),
                             rows=len(order), groups=PROMPTS, tokens=cols.tokens, publisher="i0", created="")  # fmt: skip
    rows = ReplayRows(RolloutBatch(manifest, cols, "i0/b"), "run", digest)
    assert len(rows) == len(order) and [rows[n] for n in range(len(rows))] == [honest[j] for j in order]
    assert rows[-1] == honest[order[-1]] and rows[3:5] == [honest[j] for j in order[3:5]]
    with pytest.raises(IndexError):
        rows[len(order)]

    read: list[int] = []

    class Reads(Sequence[ReplayRow]):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
            read.append(i)
            return rows[i]

    v = _replayer(model, state).check(0, Reads())
    assert v.ok, v.detail
    assert sorted(read) == list(v.rows) and len(v.rows) == 12  # the default share (0.375) of 32
    with pytest.raises(RolloutRowError, match="group id"):  # rows not of the manifest's node and version
        ReplayRows(RolloutBatch(dataclasses.replace(manifest, version=1), cols, "i0/b"), "run", digest)
