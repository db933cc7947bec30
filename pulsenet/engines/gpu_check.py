"""Cross-check engines on one device: same greedy tokens, logprobs within kernel tolerance, weights
at the published digest, before and after a few verified patches; time each update. Prints JSON.

    python -m pulsenet.engines.gpu_check --model smollm2 --device cuda --engines torch,vllm

The first engine named is the reference; each other engine is compared with it. With one engine,
a freshly built ``TorchEngine`` on the same weights is the comparison (so the CPU half runs without
vLLM: ``--model tiny --device cpu --engines torch``). Updates are real PULSESync patches: encoded
against the previous version and rebuilt through ``codec/patch.apply_patch``, which checks every
tensor and the model digest, then handed to each engine's ``update``.

Greedy tokens may legitimately part where two tokens are within ``--logprob-tol`` of each other
(different BF16 kernels); a divergence counts as a failure only when the reference engine scores
its own token more than the tolerance above the other engine's. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pulsenet.codec.digest import model_digest
from pulsenet.codec.patch import PatchEncoder, apply_patch
from pulsenet.engines.base import Engine, Generation, SamplingParams
from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
from pulsenet.errors import EngineError
from pulsenet.rl.models import (
    bf16_state_dict,
    build_tiny_model,
    load_model,
    load_tokenizer,
    save_model,
    smollm2_checkpoint,
)

SMOLLM2_PROMPTS = (
    "The capital of France is",
    "Question: what is 17 + 25?\nAnswer:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
)
TINY_PROMPTS = ("12+34=", "7*8=", "hello world, ", "9")
VLLM_TINY = {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1}
"""The tiny model with a head size vLLM's CPU attention supports (32; the default tiny model's is 16)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m pulsenet.engines.gpu_check", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--engines", default="torch,vllm", help="comma-separated: torch, vllm (first = reference)")
    p.add_argument("--patches", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--logprob-tol", type=float, default=0.1, help="max |Δ logprob| on matching tokens")
    p.add_argument("--change-fraction", type=float, default=0.05, help="entries moved per patch")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    return p.parse_args(argv)


def require(engines: list[str], device: str) -> None:
    """Fail clearly, before loading anything, when the device or vLLM is missing."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EngineError(
            f"--device {device} needs a CUDA device; none is visible (torch {torch.__version__})"
        )
    if "vllm" in engines:
        from pulsenet.engines.vllm_config import import_vllm, vllm_device_type

        import_vllm()
        found = vllm_device_type()
        if found != torch.device(device).type:
            raise EngineError(f"--device {device}, but this vLLM build runs on {found}: pass --device {found}")
    unknown = set(engines) - {"torch", "vllm"}
    if unknown or not engines:
        raise EngineError(f"unknown engines {sorted(unknown)}: choose from torch, vllm")


def next_state(
    master: dict[str, torch.Tensor], fraction: float, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Move ``fraction`` of every FP32 master tensor by ~1% of its scale (an RL-sized step seen in BF16)."""
    for t in master.values():
        if not t.is_floating_point():
            continue
        hit = torch.rand(t.shape, generator=gen) < fraction
        scale = t.abs().mean().clamp(min=1e-6)
        t.add_(torch.randn(t.shape, generator=gen) * scale * 0.01 * hit)
    return {n: t.to(torch.bfloat16) if t.is_floating_point() else t.clone() for n, t in master.items()}


def compare(
    ref: list[Generation], other: list[Generation], scorer: TorchEngine, tol: float
) -> dict[str, Any]:
    """Token agreement and logprob gap of ``other`` against ``ref`` (greedy), prompt by prompt."""
    exact, near_ties, failures, worst = 0, 0, [], 0.0
    for i, (a, b) in enumerate(zip(ref, other, strict=True)):
        k = 0
        while (
            k < min(len(a.completion_ids), len(b.completion_ids))
            and a.completion_ids[k] == b.completion_ids[k]
        ):
            k += 1
        if k:
            worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs[:k], b.logprobs[:k], strict=True)))
        if a.completion_ids == b.completion_ids:
            exact += 1
            continue
        if k < min(len(a.completion_ids), len(b.completion_ids)):
            prefix = list(a.completion_ids[:k])
            own = scorer.score(a.prompt_ids, [*prefix, a.completion_ids[k]])[-1]
            theirs = scorer.score(a.prompt_ids, [*prefix, b.completion_ids[k]])[-1]
            if own - theirs <= tol:
                near_ties += 1
                continue
            failures.append({"prompt": i, "position": k, "margin": own - theirs})
        else:  # one stopped earlier: same tokens up to there, a stop token decided differently
            failures.append(
                {"prompt": i, "position": k, "lengths": [len(a.completion_ids), len(b.completion_ids)]}
            )
    return {
        "exact": exact,
        "near_ties": near_ties,
        "failures": failures,
        "max_abs_logprob_diff": worst,
        "ok": not failures and worst <= tol,
    }


def build(kind: str, model_dir: Path, device: str, state: dict[str, torch.Tensor], digest: str) -> Engine:
    if kind == "torch":
        return TorchEngine.from_pretrained(model_dir, version=0, config=TorchEngineConfig(device=device))
    from pulsenet.engines.vllm_config import VLLMEngineConfig
    from pulsenet.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, VLLMEngineConfig(enforce_eager=True), state=state, version=0, digest=digest)


def own_digest(engine: Engine) -> str:
    """The digest of what the engine runs: its parameters (torch) or its HF host mirror (vLLM)."""
    return engine.weights_digest() if isinstance(engine, TorchEngine) else model_digest(engine.served_state())


def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    require(kinds, args.device)
    tmp = tempfile.TemporaryDirectory(prefix="pulsenet-gpu-check-")
    try:
        if args.model == "smollm2":
            model_dir = smollm2_checkpoint()
            tok = load_tokenizer(model_dir)
            prompts = [tok(p)["input_ids"] for p in SMOLLM2_PROMPTS]
        else:
            model_dir = save_model(build_tiny_model(0, **VLLM_TINY), Path(tmp.name) / "tiny")
            prompts = [list(p.encode()) for p in TINY_PROMPTS]
        model = load_model(model_dir)
        hf_config = model.config  # the architecture a fresh torch engine is built with
        master = {n: t.detach().float().clone() for n, t in bf16_state_dict(model).items()}
        del model
        state = {n: t.to(torch.bfloat16) for n, t in master.items()}
        digest = model_digest(state)
        t0 = time.perf_counter()
        engines = {k: build(k, model_dir, args.device, state, digest) for k in kinds}
        build_s = time.perf_counter() - t0
        greedy = SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens)
        ref_name = kinds[0]
        # scores near ties: torch (with two kinds of engine one of them is torch, the only other is vllm)
        scorer = next((e for e in engines.values() if isinstance(e, TorchEngine)), None)
        encoder, gen = PatchEncoder(), torch.Generator().manual_seed(0)
        phases, updates = [], []
        for version in range(args.patches + 1):
            if version:
                old, old_digest = state, digest
                new = next_state(master, args.change_fraction, gen)
                blob = encoder.encode(old, new, base_digest=old_digest)
                state = apply_patch(old, blob, base_digest=old_digest)  # verified tensor by tensor + digest
                digest = model_digest(state)
                for name, engine in engines.items():
                    t = time.perf_counter()
                    engine.update(version, state, digest)
                    updates.append(
                        {
                            "engine": name,
                            "version": version,
                            "patch_bytes": len(blob),
                            "wall_s": time.perf_counter() - t,
                            "apply_s": engine.stats.update_apply_s[-1],
                        }
                    )
            outputs = {name: e.generate(prompts, greedy) for name, e in engines.items()}
            phase: dict[str, Any] = {"version": version, "digest": digest, "digests_equal": {}, "compare": {}}
            for name, engine in engines.items():
                labelled = all(g.version == version and g.digest == digest for g in outputs[name])
                phase["digests_equal"][name] = (
                    labelled and engine.digest == digest and own_digest(engine) == digest
                )
            others = [n for n in kinds if n != ref_name]
            if others:
                if scorer is None:
                    raise EngineError(f"comparing engines {kinds} needs the torch engine among them to score near ties")
                for name in others:
                    phase["compare"][name] = compare(outputs[ref_name], outputs[name], scorer, args.logprob_tol)
            else:  # one engine: compare it with a freshly built torch engine on the same weights
                fresh = TorchEngine.from_state(
                    hf_config,
                    state,
                    digest,
                    version=version,
                    config=TorchEngineConfig(device=args.device),
                )
                phase["compare"]["fresh-torch"] = compare(
                    outputs[ref_name], fresh.generate(prompts, greedy), fresh, args.logprob_tol
                )
            phase["tokens"] = {name: [list(g.completion_ids) for g in out] for name, out in outputs.items()}
            phase["logprobs"] = {name: [list(g.logprobs) for g in out] for name, out in outputs.items()}
            phases.append(phase)
        for engine in engines.values():
            engine.close()
        # Each patch must change what is served: the reference's greedy tokens or their logprobs.
        changed = [
            phases[i]["logprobs"][ref_name] != phases[i + 1]["logprobs"][ref_name]
            for i in range(len(phases) - 1)
        ]
        ok = all(
            all(p["digests_equal"].values()) and all(c["ok"] for c in p["compare"].values()) for p in phases
        )
        return {
            "model": args.model,
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "engines": kinds,
            "build_s": build_s,
            "phases": phases,
            "updates": updates,
            "outputs_changed_by_patches": changed,
            "ok": ok,
        }
    finally:
        tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except EngineError as e:
        print(json.dumps({"ok": False, "error": str(e)}))
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.json is not None:
        args.json.write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
