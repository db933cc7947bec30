"""How close honest vLLM rows come to a replay refusal: the margins behind docs/engines.md.

The vLLM engine samples every token with the public draw (engines/vllm_draw.py), computing in BF16;
a trainer replays rows in an FP32 forward on the same BF16 values (rl/replay.py). This script
generates rows with vLLM for public draw keys, replays *every* row with ``Replayer`` at
ReplayConfig's default tolerances, batch by batch (``--batch`` rows, as an inference node writes
them), and prints the batches refused, the tokens beyond each tolerance, and the distribution of
|Δ log-prob| and of each token's CDF margin (how far below zero; the minimum). With ``--compare``
the torch engine samples the same draws and the per-token agreement of the two engines is shown.

    PYTHONPATH=. python scripts/replay_margins_vllm.py --model tiny --rows 10000
    PYTHONPATH=. python scripts/replay_margins_vllm.py --model smollm2 --seconds 900

``tiny``: the random tiny Llama of tests/integration/test_vllm_engine.py (head size 32; layers x6, final norm
x2 so its distributions depend on the context), byte-level prompts. ``smollm2``: SmolLM2-135M
(``rl.models.smollm2_checkpoint``), arithmetic questions through its tokenizer. Needs vLLM.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny", help="tiny, smollm2 or a HF model directory")
    p.add_argument("--rows", type=int, default=10_000, help="rows to generate and replay at most")
    p.add_argument("--seconds", type=float, default=None, help="stop generating after this long")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--batch", type=int, default=16, help="rows per replayed batch (one Replayer.check)")
    p.add_argument("--chunk", type=int, default=256, help="rows per engine call")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", default="auto", help="the vLLM engine's compute dtype (VLLMEngineConfig.dtype)")
    p.add_argument("--compare", action="store_true", help="also sample with the torch engine; token agreement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the summary here too")
    return p.parse_args()


def tiny_dir(path: Path) -> tuple[Path, dict[str, torch.Tensor], list[list[int]], None]:
    from pulsenet.engines.gpu_check import VLLM_TINY
    from pulsenet.rl.models import bf16_state_dict, build_tiny_model

    model = build_tiny_model(0, **VLLM_TINY)
    with torch.no_grad():  # as tests/integration/test_vllm_engine.py initial_state
        for name, p in model.named_parameters():
            if ".layers." in name and p.dim() == 2:
                p.mul_(6.0)
        model.model.norm.weight.mul_(2.0)
    model.config.save_pretrained(path)
    texts = [f"{a}+{b}=" for a in range(100) for b in range(10)] + [f"x{a} = " for a in range(200)]
    return path, bf16_state_dict(model), [list(t.encode()) for t in texts], None


def hf_dir(path: Path) -> tuple[Path, dict[str, torch.Tensor], list[list[int]], object]:
    from transformers import AutoTokenizer

    from pulsenet.rl.models import bf16_state_dict, load_model

    tok = AutoTokenizer.from_pretrained(path)
    state = bf16_state_dict(load_model(path))
    texts = [f"Question: what is {a} + {b}? Think step by step, then give the answer.\nAnswer:" for a in range(60)
             for b in range(0, 60, 3)]  # fmt: skip
    return path, state, [tok(t)["input_ids"] for t in texts], tok


def quantiles(x: torch.Tensor) -> dict[str, float]:
    x = x.double()
    qs = {"50%": 0.5, "99%": 0.99, "99.9%": 0.999}
    out = {k: float(torch.quantile(x, q)) for k, q in qs.items()} if x.numel() else {}
    return {**out, "max": float(x.max()) if x.numel() else 0.0}


def main() -> None:
    args = parse_args()
    from transformers import AutoConfig

    from pulsenet.codec.digest import model_digest
    from pulsenet.engines.torch_engine import TorchEngine, TorchEngineConfig
    from pulsenet.engines.vllm_config import VLLMEngineConfig
    from pulsenet.engines.vllm_engine import VLLMEngine
    from pulsenet.rl.draw import DrawId
    from pulsenet.rl.models import smollm2_checkpoint
    from pulsenet.rl.replay import ReplayConfig, Replayer, ReplayRow
    from pulsenet.rl.sampling import SamplingParams

    tmp = tempfile.TemporaryDirectory()
    if args.model == "tiny":
        path, state, prompts, _ = tiny_dir(Path(tmp.name))
    else:
        path, state, prompts, _ = hf_dir(smollm2_checkpoint() if args.model == "smollm2" else Path(args.model))
    digest = model_digest(state)
    hf_config = AutoConfig.from_pretrained(path)
    t0 = time.perf_counter()
    engine = VLLMEngine(path, VLLMEngineConfig(enforce_eager=True, kv_cache_gib=0.5, dtype=args.dtype), state=state, version=0,
                        digest=digest)  # fmt: skip
    start_s = time.perf_counter() - t0
    ref = TorchEngine.from_state(hf_config, state, digest, version=0, config=TorchEngineConfig(device="cpu")) \
        if args.compare else None  # fmt: skip
    base = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens)
    replayer = Replayer(hf_config, base, ReplayConfig(engine="vllm:float32"), keep=1)
    replayer.remember(0, state)
    rng = random.Random(args.seed)
    margins, diffs, refused = [], [], {}
    rows = batches = tokens = 0
    agree_pos = agree_div = 0
    gen_s = replay_s = 0.0
    t_start = time.perf_counter()
    try:
        while rows < args.rows and (args.seconds is None or time.perf_counter() - t_start < args.seconds):
            n_prompts = max(1, min(args.chunk, args.rows - rows) // args.group)
            chosen = [rng.choice(prompts) for _ in range(n_prompts)]
            call = [p for p in chosen for _ in range(args.group)]
            at = [(rows + j) // args.batch for j in range(len(call))]  # the replayed batch each row is in
            keys = [DrawId("replay-margins", digest, "i0", 0, at[j], ((rows + j) % args.batch) // args.group,
                           j % args.group).key() for j in range(len(call))]  # fmt: skip
            params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                    max_new_tokens=args.max_new_tokens, draws=tuple(keys))  # fmt: skip
            t = time.perf_counter()
            gens = engine.generate(call, params)
            gen_s += time.perf_counter() - t
            if ref is not None:
                for a, b in zip(gens, ref.generate(call, params), strict=True):
                    for x, y in zip(a.completion_ids, b.completion_ids, strict=False):
                        agree_pos += 1
                        if x != y:
                            agree_div += 1
                            break
            t = time.perf_counter()
            for s in range(0, len(gens), args.batch):
                part = [ReplayRow(g.prompt_ids, g.completion_ids, g.logprobs, k)
                        for g, k in zip(gens[s : s + args.batch], keys[s : s + args.batch], strict=True)]  # fmt: skip
                v = replayer.check(0, part, picked=range(len(part)))
                batches += 1
                if v.reason is not None:
                    refused[v.reason] = refused.get(v.reason, 0) + 1
                    print(f"batch {batches}: refused {v.reason}: {v.detail}", flush=True)
                margins.append(v.margins)
                diffs.append(v.logprob_diffs)
                tokens += v.margins.numel()
            replay_s += time.perf_counter() - t
            rows += len(gens)
            print(f"{rows} rows, {tokens} tokens, {batches} batches, refused {refused}", flush=True)
    finally:
        engine.close()
    m, d = torch.cat(margins), torch.cat(diffs)
    c = ReplayConfig(engine="vllm:float32").tolerances()
    summary = {
        "model": args.model, "dtype": engine.config.compute_dtype(engine.device_type),
        "temperature": args.temperature, "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens, "rows": rows, "tokens": tokens, "batches": batches,
        "batches_refused": refused, "tolerances": {"cdf": c.cdf, "logprob": c.logprob},
        "tokens_over_cdf_tolerance": int((m < -c.cdf).sum()),
        "tokens_over_logprob_tolerance": int((d > c.logprob).sum()),
        "abs_dlogprob": quantiles(d),
        "cdf_below_zero": quantiles((-m).clamp(min=0)),
        "tokens_below_zero": int((m < 0).sum()),
        "min_margin": float(m.min()),
        "agreement_per_token": None if ref is None else 1 - agree_div / max(agree_pos, 1),
        "seconds": {"start": round(start_s, 1), "generate": round(gen_s, 1), "replay": round(replay_s, 1)},
    }  # fmt: skip
    print(json.dumps(summary, indent=1))
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
