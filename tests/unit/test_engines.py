"""Inference engines: sampling against a plain full forward, seeding, stopping, and in-place updates
through real PULSESync versions that stay bit-identical to the published digest."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pulsenet.codec.digest import model_digest
from pulsenet.engines import gpu_check
from pulsenet.engines.base import SamplingParams
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.engines.vllm_engine import HostMirror
from pulsenet.errors import ConfigError, EngineError
from pulsenet.rl.models import bf16_state_dict, build_tiny_model
from pulsenet.store import LocalStore
from pulsenet.sync.publisher import Publisher, PublisherConfig
from pulsenet.sync.subscriber import Subscriber, SubscriberConfig
from tests.support.sync_support import keypair, train_states

ROOT = Path(__file__).resolve().parents[2]
CPU = TorchEngineConfig(device="cpu")
PROMPTS = [list(b"12+34="), list(b"7*8="), list(b"hello world, "), list(b"9")]


def engine(seed: int = 0, **kw: object) -> TorchEngine:
    return TorchEngine(build_tiny_model(seed), TorchEngineConfig(device="cpu", **kw), version=0)  # type: ignore[arg-type]


def reference_logits(seed: int, sequence: list[int]) -> torch.Tensor:
    """Full-sequence FP32 logits of an independently built model on fp32(bf16(w)), no cache, no padding."""
    model = build_tiny_model(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(t.to(torch.bfloat16))
        return model(input_ids=torch.tensor([sequence])).logits[0].float()


def test_digest_is_the_published_bf16_digest() -> None:
    eng = engine()
    published = model_digest(bf16_state_dict(build_tiny_model(0)))
    assert eng.digest == published
    assert eng.weights_digest() == published
    assert all(t.dtype == torch.float32 for t in eng.model.parameters())  # CPU computes in FP32


def test_greedy_matches_full_forward_argmax() -> None:
    gens = engine().generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=12, stop_at_eos=False))
    for prompt, g in zip(PROMPTS, gens, strict=True):
        seq = list(prompt)
        for tok, lp in zip(g.completion_ids, g.logprobs, strict=True):
            logits = reference_logits(0, seq)[-1]
            assert tok == int(logits.argmax())
            assert abs(lp - float(torch.log_softmax(logits, -1)[tok])) < 1e-5
            seq.append(tok)
        assert g.finish_reason == "length" and len(g.completion_ids) == 12
        assert g.version == 0 and g.prompt_ids == tuple(prompt)
    row = gens[0].to_rollout(group="g0", reward=1.0, node="n1")
    assert (row.completion_ids, row.logprobs, row.version, row.model_digest, row.seed) == (
        gens[0].completion_ids,
        gens[0].logprobs,
        0,
        gens[0].digest,
        gens[0].seed,
    )


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_logprobs_equal_full_forward_log_softmax(temperature: float, top_p: float) -> None:
    params = SamplingParams(
        temperature=temperature, top_p=top_p, max_new_tokens=16, seed=3, stop_at_eos=False
    )
    gens = engine().generate(PROMPTS * 2, params)
    worst = 0.0
    for g in gens:
        logits = reference_logits(0, [*g.prompt_ids, *g.completion_ids])
        steps = logits[len(g.prompt_ids) - 1 : -1] / temperature
        ref = torch.log_softmax(steps, -1).gather(1, torch.tensor(g.completion_ids)[:, None])[:, 0]
        worst = max(worst, float((ref - torch.tensor(g.logprobs)).abs().max()))
        if top_p < 1:  # every sampled token lies in its nucleus: the tokens above it hold < top_p
            probs = steps.softmax(-1)
            for row, tok in zip(probs, g.completion_ids, strict=True):
                assert float(row[row > row[tok]].sum()) < top_p
    assert worst < 1e-5


def test_same_seed_same_samples_other_seed_differs() -> None:
    eng = engine()
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=11, stop_at_eos=False)
    a = eng.generate(PROMPTS, params)
    b = eng.generate(PROMPTS, params)
    assert [g.completion_ids for g in a] == [g.completion_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    assert [g.seed for g in a] == [11, 12, 13, 14]
    c = eng.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=24, seed=12, stop_at_eos=False))
    assert [g.completion_ids for g in a] != [g.completion_ids for g in c]
    # A group: the same prompt G times draws G different completions; completion i of a call is
    # reproducible on its own (its seed), whatever shares the batch.
    group = eng.generate([PROMPTS[0]] * 4, params)
    assert len({g.completion_ids for g in group}) > 1
    assert group[0].completion_ids == a[0].completion_ids


def test_tiny_top_p_is_greedy_and_records_untruncated_logprobs() -> None:
    eng = engine()
    greedy = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8, stop_at_eos=False))
    nucleus = eng.generate(
        PROMPTS, SamplingParams(temperature=0.5, top_p=1e-6, max_new_tokens=8, stop_at_eos=False)
    )
    for g, n in zip(greedy, nucleus, strict=True):
        assert g.completion_ids == n.completion_ids
        assert all(lp < -1e-3 for lp in n.logprobs)  # log p under T=0.5, not log 1 after truncation


def test_stop_tokens_and_max_new_tokens() -> None:
    eng = engine()
    free = eng.generate(
        PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=20, seed=5, stop_at_eos=False)
    )
    stop = free[1].completion_ids[4]
    stopped = eng.generate(
        PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=20, seed=5, stop_token_ids=(stop,))
    )
    for f, s in zip(free, stopped, strict=True):
        if stop in f.completion_ids:
            k = f.completion_ids.index(stop) + 1
            assert s.completion_ids == f.completion_ids[:k] and s.finish_reason == "stop"
            assert s.logprobs == f.logprobs[:k]
        else:
            assert s.completion_ids == f.completion_ids and s.finish_reason == "length"
    assert stopped[1].completion_ids[-1] == stop and len(stopped[1].completion_ids) <= 5
    # EOS from the model config (byte 10 for the tiny model) stops by default.
    assert eng.eos_ids == (10,)
    short = eng.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=3))
    assert all(len(g.completion_ids) <= 3 for g in short)


def test_bad_params_and_prompts_are_refused() -> None:
    with pytest.raises(ConfigError):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError):
        SamplingParams(temperature=-1)
    with pytest.raises(EngineError):
        engine().generate([[]], SamplingParams())
    with pytest.raises(EngineError):  # 512 positions
        engine().generate([[1] * 500], SamplingParams(max_new_tokens=20))


async def test_pulsesync_updates_keep_weights_at_the_published_digest(tmp_path: Path) -> None:
    """Real versions through Publisher -> LocalStore -> Subscriber -> engine.update."""
    states = train_states(4, lr=1e-3)
    key, trusted = keypair()
    store = LocalStore(tmp_path / "store")
    eng = engine()
    sub = Subscriber(store, trusted, SubscriberConfig(interval_s=0.05), on_update=eng.update)
    greedy = SamplingParams(temperature=0, max_new_tokens=10, stop_at_eos=False)
    seen_outputs = set()
    async with Publisher(store, key, PublisherConfig(anchor_every=10)) as pub, sub:
        for i, state in enumerate(states):
            record = await pub.publish_now(state, step=i)
            assert await sub.sync_once() == record.version
            assert eng.version == record.version and eng.digest == record.digest
            assert eng.weights_digest() == record.digest  # the engine's own parameters, rehashed
            fresh = TorchEngine.from_state(
                eng.model.config, state, record.digest, version=record.version, config=CPU
            )
            mine, theirs = eng.generate(PROMPTS, greedy), fresh.generate(PROMPTS, greedy)
            assert [g.completion_ids for g in mine] == [g.completion_ids for g in theirs]
            assert [g.logprobs for g in mine] == [g.logprobs for g in theirs]
            assert all(g.version == record.version and g.digest == record.digest for g in mine)
            seen_outputs.add(tuple(g.logprobs for g in mine))
    assert len(seen_outputs) == len(states)  # every update changed what is served
    assert eng.stats.updates == len(states) and len(eng.stats.update_apply_s) == len(states)


def test_only_changed_tensors_are_copied() -> None:
    eng = engine()
    state = eng.served_state()
    name = "model.layers.0.mlp.up_proj.weight"
    state[name] = (state[name].float() * 1.5).to(torch.bfloat16)
    eng.update(1, state, model_digest(state))
    assert eng.stats.tensors_copied == 1 and eng.stats.bytes_copied == state[name].numel() * 2
    assert eng.weights_digest() == model_digest(state)
    eng.update(2, state, model_digest(state), changed=set())  # nothing changed: version moves, no copy
    assert eng.version == 2 and eng.stats.tensors_copied == 1
    other = "model.layers.1.self_attn.o_proj.weight"
    lying = {**state, other: (state[other].float() * 2).to(torch.bfloat16)}
    with pytest.raises(EngineError, match="published"):  # the hint hides a change: the digest catches it
        eng.update(3, lying, model_digest(lying), changed={name})
    eng.update(3, lying, model_digest(lying), changed={other})  # the true hint repairs it
    assert eng.version == 3 and eng.weights_digest() == model_digest(lying)


def test_update_during_generate_waits_for_the_batch() -> None:
    eng = engine()
    params = SamplingParams(temperature=0, max_new_tokens=8, stop_at_eos=False)
    before = eng.generate(PROMPTS, params)
    new = bf16_state_dict(build_tiny_model(1))
    new_digest = model_digest(new)
    forward = eng._forward
    calls = []

    def forward_then_update(*args: object) -> object:
        calls.append(eng.version)
        if len(calls) == 2:  # mid-batch: the engine must park it
            eng.update(7, new, new_digest)
            assert eng.stats.deferred_updates == 1 and eng.version == 0  # parked, not applied
        return forward(*args)

    eng._forward = forward_then_update  # type: ignore[method-assign]
    during = eng.generate(PROMPTS, params)
    eng._forward = forward  # type: ignore[method-assign]
    assert calls == [0] * 8  # every step of the batch ran on v0
    assert [g.completion_ids for g in during] == [g.completion_ids for g in before]
    assert [g.logprobs for g in during] == [g.logprobs for g in before]
    assert all(g.version == 0 for g in during)
    assert eng.version == 7 and eng.digest == new_digest  # applied once the batch ended
    assert eng.stats.deferred_updates == 1 and eng.stats.updates_failed == 0
    assert eng.weights_digest() == new_digest
    after = eng.generate(PROMPTS, params)
    assert all(g.version == 7 for g in after)
    assert [g.logprobs for g in after] != [g.logprobs for g in before]


def test_bad_updates_never_serve() -> None:
    eng = engine()
    state = eng.served_state()
    first = next(iter(state))
    with pytest.raises(EngineError, match="missing"):
        eng.update(1, {k: v for k, v in state.items() if k != first}, eng.digest)
    wrong_shape = {**state, first: state[first][:-1]}
    with pytest.raises(EngineError, match="served"):
        eng.update(1, wrong_shape, eng.digest)
    assert eng.version == 0 and eng.weights_digest() == eng.digest  # refused before touching anything
    changed = {**state, first: (state[first].float() + 1).to(torch.bfloat16)}
    with pytest.raises(EngineError, match="published"):
        eng.update(1, changed, eng.digest)  # the digest does not match what would be served
    with pytest.raises(EngineError, match="refusing"):
        eng.generate(PROMPTS, SamplingParams())
    eng.update(2, state, model_digest(state))  # a verified update repairs it
    assert eng.version == 2 and eng.weights_digest() == model_digest(state)
    assert len(eng.generate(PROMPTS, SamplingParams(max_new_tokens=2))) == len(PROMPTS)


def test_max_batch_splits_but_keeps_seeds() -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=2, stop_at_eos=False)
    whole = engine().generate(PROMPTS, params)
    split = engine(max_batch=3).generate(PROMPTS, params)
    assert [g.seed for g in split] == [g.seed for g in whole]
    assert [g.completion_ids for g in split] == [g.completion_ids for g in whole]


# --- vLLM engine parts that run without vLLM, and the cross-check script ------------------------


def test_host_mirror_checks_the_digest_before_anything_is_sent() -> None:
    base = bf16_state_dict(build_tiny_model(0))
    mirror = HostMirror(base)
    assert mirror.digest == model_digest(base)
    new = dict(base)
    name = "model.norm.weight"
    new[name] = (base[name].float() + 0.5).to(torch.bfloat16)
    with pytest.raises(EngineError, match="refused"):
        mirror.stage(new, model_digest(base))  # right tensors, wrong published digest
    assert mirror.digest == model_digest(base)  # nothing staged stays behind
    with pytest.raises(EngineError, match="refused"):
        mirror.stage(new, model_digest(new), changed=set())  # a hint that hides the change
    tensors, records = mirror.stage(new, model_digest(new))
    assert list(tensors) == [name]  # only what changed is sent to the workers
    mirror.commit(tensors, records)
    assert mirror.digest == model_digest(new) and model_digest(mirror.tensors) == model_digest(new)


def test_gpu_check_refuses_a_device_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():  # the refusal under test is for CPU-only machines
        return
    assert gpu_check.main(["--device", "cuda", "--engines", "torch,vllm"]) == 2
    err = capsys.readouterr()
    assert "CUDA" in err.err and json.loads(err.out)["ok"] is False


def test_gpu_check_torch_half_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    rc = gpu_check.main(
        [
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--engines",
            "torch",
            "--max-new-tokens",
            "8",
            "--json",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    assert rc == 0 and report["ok"]
    assert [p["version"] for p in report["phases"]] == [0, 1, 2, 3]
    assert all(p["digests_equal"]["torch"] for p in report["phases"])
    assert all(p["compare"]["fresh-torch"]["max_abs_logprob_diff"] == 0.0 for p in report["phases"])
    assert report["outputs_changed_by_patches"] == [True, True, True]
    assert [u["version"] for u in report["updates"]] == [1, 2, 3] and all(
        u["apply_s"] > 0 for u in report["updates"]
    )


@pytest.mark.gpu
def test_gpu_check_script_on_cuda(tmp_path: Path) -> None:
    """SmolLM2 on both engines (torch only where vLLM is not installed); the only test allowed to skip."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    has_vllm = importlib.util.find_spec("vllm") is not None
    engines = "torch,vllm" if has_vllm else "torch"
    out = tmp_path / "gpu_check.json"
    channel = tmp_path / "channel_check.json"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), "--engines", engines],
        env={**os.environ, "OUT": str(out), "OUT_CHANNEL": str(channel), "PYTHON": sys.executable,
             "ENGINE": "vllm" if has_vllm else "torch"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["updates"]) == 3 * len(engines.split(","))
    assert json.loads(channel.read_text())["ok"]


@pytest.mark.integration
def test_channel_check_torch_half_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """An engine behind a live PULSESync channel (embedded SeaweedFS): built from v0, updated with the
    changed names only, every completion labelled with the published digest."""
    from pulsenet.nodes import channel_check

    assert channel_check.main(["--engine", "torch", "--model", "tiny", "--device", "cpu", "--versions", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and [v["version"] for v in report["versions"]] == [0, 1, 2, 3]
    assert all(0 < v["tensors_changed"] <= 13 for v in report["versions"][1:]) and report["pulsesync_bytes"] > 0


def test_a_bad_deferred_update_never_costs_the_batch() -> None:
    eng = engine()
    params = SamplingParams(temperature=0, max_new_tokens=4, stop_at_eos=False)
    state = eng.served_state()
    first = next(iter(state))
    bad_shape = {**state, first: state[first][:-1]}
    bad_digest = {**state, first: (state[first].float() + 1).to(torch.bfloat16)}
    forward = eng._forward

    def run_with_update(update: dict[str, torch.Tensor]) -> list:
        sent = []

        def forward_then_update(*args: object) -> object:
            if not sent:
                sent.append(1)
                eng.update(9, update, eng.digest)
            return forward(*args)

        eng._forward = forward_then_update  # type: ignore[method-assign]
        try:
            return eng.generate(PROMPTS, params)
        finally:
            eng._forward = forward  # type: ignore[method-assign]

    out = run_with_update(bad_shape)  # refused before touching anything: logged, counted, still v0
    assert len(out) == len(PROMPTS) and eng.stats.updates_failed == 1 and eng.version == 0
    assert len(eng.generate(PROMPTS, params)) == len(PROMPTS)
    out = run_with_update(bad_digest)  # the batch still returns; then the engine refuses to serve
    assert len(out) == len(PROMPTS) and all(g.version == 0 for g in out) and eng.stats.updates_failed == 2
    with pytest.raises(EngineError, match="refusing"):
        eng.generate(PROMPTS, params)


# --- the engine factory and the changed-names hint ----------------------------------------------------


def test_make_engine_builds_from_channel_weights_and_checks_the_layout() -> None:
    from pulsenet.engines import make_engine
    from pulsenet.rl.prompts import byte_codec

    state = bf16_state_dict(build_tiny_model(1))
    digest = model_digest(state)
    eng = make_engine("torch", model="tiny", state=state, digest=digest, version=7, codec=byte_codec(), torch_config=CPU)
    assert isinstance(eng, TorchEngine) and (eng.version, eng.digest) == (7, digest)
    assert eng.weights_digest() == digest
    out = eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, stop=("+",)))
    assert out[0].version == 7
    with pytest.raises(ConfigError, match="engine must be one of"):
        make_engine("tensorrt", model="tiny", state=state, digest=digest)
    narrow = {**state, "model.norm.weight": state["model.norm.weight"][:10].clone()}
    with pytest.raises(ConfigError, match=r"tensor model\.norm\.weight is .*\(10,\) in the channel"):
        make_engine("torch", model="tiny", state=narrow, digest=model_digest(narrow))


def test_the_changed_hint_spares_comparing_and_hashing_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the names a verified patch changed, an update touches only those (torch and vLLM's mirror)."""
    import pulsenet.engines.base as base
    import pulsenet.engines.torch_engine as te
    import pulsenet.engines.vllm_engine as ve

    compared: list[int] = []
    hashed: list[str] = []
    real_same, real_record = base.same_bits, te.tensor_record

    def counting_same(a: torch.Tensor, b: torch.Tensor) -> bool:
        compared.append(1)
        return real_same(a, b)

    def counting_record(name: str, *args: object) -> bytes:
        hashed.append(name)
        return real_record(name, *args)  # type: ignore[arg-type]

    eng = engine()
    state = eng.served_state()
    mirror = HostMirror(state)
    name = "model.layers.1.mlp.down_proj.weight"
    state[name] = (state[name].float() * 1.25).to(torch.bfloat16)
    digest = model_digest(state)
    for module in (te, ve):
        monkeypatch.setattr(module, "same_bits", counting_same)
    monkeypatch.setattr(te, "tensor_record", counting_record)
    monkeypatch.setattr(ve, "tensor_record", counting_record)
    eng.update(1, state, digest, changed={name})
    assert len(compared) == 1 and hashed == [name] and eng.weights_digest() == digest
    compared.clear()
    hashed.clear()
    tensors, _ = mirror.stage(state, digest, changed={name})
    assert list(tensors) == [name] and len(compared) == 1 and hashed == [name]
    compared.clear()
    mirror.stage(state, digest)  # no hint: every tensor is compared (bits, not hashes)
    assert len(compared) == len(state)


async def test_an_inference_node_discards_a_batch_with_a_completion_that_spans_an_update(tmp_path: Path) -> None:
    """A completion flagged ``spans_update`` (vLLM ``in_flight="keep"``: tokens of two versions)
    can never pass replay: the node writes none of its batch and counts the rows it threw away in
    ``/status`` (``rollouts.discarded_spanning``); the next, clean batch is written. The flag is
    set on one real PyTorch-engine completion here (vLLM sets it: tests/test_vllm_engine.py)."""
    import dataclasses

    from pulsenet.nodes.build import compose_inference
    from pulsenet.nodes.common import text_codec
    from pulsenet.nodes.config import InferenceConfig
    from pulsenet.rl.tasks import TaskConfig, build_task

    key, trusted = keypair()
    node = compose_inference(
        InferenceConfig(id="i0", run="spans", prompts=2, group_size=2, task=TaskConfig(max_new_tokens=2),
                        state_dir=tmp_path / "i0"),
        store=LocalStore(tmp_path / "i0s"), policy_stores=[LocalStore(tmp_path / "t0")], trusted=trusted, key=key,
        task=build_task("arith", seed=0), text=text_codec("tiny"),
    )  # fmt: skip
    eng = engine()
    real = eng.generate

    def one_spans(prompts: list[list[int]], params: SamplingParams) -> list:
        return [dataclasses.replace(g, spans_update=i == 1) for i, g in enumerate(real(prompts, params))]

    node.engine = eng
    eng.generate = one_spans  # type: ignore[method-assign]
    await node.generate_batch()
    assert node.writer.stats.batches == 0 and node.state.rollouts["produced"] == 0
    assert node.state.rollouts["discarded_spanning"] == 4 and node.state.to_json()["rollouts"]["discarded_spanning"] == 4
    eng.generate = real  # type: ignore[method-assign]
    await node.generate_batch()
    assert node.writer.stats.batches == 1 and node.state.rollouts["produced"] == 4


def test_a_released_host_mirror_stages_by_records_and_takes_the_new_state_whole() -> None:
    """``HostMirror.release`` drops its tensors (an in-place rebuild is about to replace them): it
    still refuses an update whose digest is not the published one, finds the changed tensors by
    their records, and then holds the whole new state's tensors, none of the old."""
    base = bf16_state_dict(build_tiny_model(0))
    mirror = HostMirror(base)
    mirror.release()
    assert mirror.released and mirror.tensors == {} and mirror.digest == model_digest(base)
    new = dict(base)
    name = "model.layers.0.mlp.down_proj.weight"
    new[name] = (base[name].float() * 1.25).to(torch.bfloat16)
    with pytest.raises(EngineError, match="refused"):
        mirror.stage(new, model_digest(base))
    with pytest.raises(EngineError, match="refused"):
        mirror.stage(new, model_digest(new), changed={"model.norm.weight"})  # a hint that hides the change
    with pytest.raises(EngineError, match="served model"):  # the layout is kept without the tensors
        mirror.stage({**new, "extra": new[name]}, model_digest(new))
    tensors, records = mirror.stage(new, model_digest(new))  # no hint: every record compared
    assert list(tensors) == [name] and tensors[name].data_ptr() == new[name].data_ptr()
    with pytest.raises(EngineError, match="whole state"):
        mirror.commit(tensors, records)
    assert mirror.released  # nothing half taken
    mirror.commit(tensors, records, new)
    assert not mirror.released and mirror.digest == model_digest(new) == model_digest(mirror.tensors)
    assert all(mirror.tensors[n].data_ptr() == new[n].data_ptr() for n in new)


async def test_an_inference_node_has_its_engine_let_go_only_of_the_channel_it_was_handed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before a channel's subscriber rebuilds its state in place, the node has the engine let go of
    that state's tensors (``Engine.release_shared_state``), but only when the engine was handed
    that channel's state: another channel's rebuild leaves the engine's alone."""
    from pulsenet.nodes.build import compose_inference
    from pulsenet.nodes.common import text_codec
    from pulsenet.nodes.config import InferenceConfig
    from pulsenet.rl.tasks import TaskConfig, build_task

    key, trusted = keypair()
    stores = [LocalStore(tmp_path / "t0"), LocalStore(tmp_path / "t1")]
    node = compose_inference(
        InferenceConfig(id="i0", run="release", prompts=2, group_size=2, task=TaskConfig(max_new_tokens=2),
                        state_dir=tmp_path / "i0"),
        store=LocalStore(tmp_path / "i0s"), policy_stores=stores, trusted=trusted, key=key,
        task=build_task("arith", seed=0), text=text_codec("tiny"),
    )  # fmt: skip
    states = train_states(3)
    released: list[int | None] = []
    pubs = [Publisher(s, key, PublisherConfig(anchor_every=10, run="release")) for s in stores]
    async with pubs[0], pubs[1], node.subscribers[0], node.subscribers[1]:

        async def version(channel: int, v: int) -> None:
            await pubs[channel].publish_now(states[v], step=v)
            assert await node.subscribers[channel].sync_once() == v

        await version(0, 0)  # the engine is built from channel 0's state
        assert node.engine is not None
        real = node.engine.release_shared_state
        monkeypatch.setattr(node.engine, "release_shared_state", lambda: released.append(node._engine_channel) or real())
        await version(1, 0)  # not newer: the engine keeps channel 0's
        await version(1, 1)  # channel 1 rebuilds in place: the engine holds channel 0's, nothing to let go
        assert released == [] and node.engine.version == 1
        await version(0, 1)  # channel 0 rebuilds: the engine now holds channel 1's (it served v1 from there)
        assert released == []
        await version(1, 2)  # channel 1 rebuilds the state the engine was handed: let go first
        assert released == [1] and node.engine.version == 2 and node.engine.weights_digest() == node.engine.digest
