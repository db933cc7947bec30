"""``pulsenet bench engines``: the PyTorch engine and vLLM side by side on one machine (CPU or CUDA).

For each engine, built from the same verified weights (``make_engine``, as an inference node does):

- ``start_s``: building the engine until it can generate (vLLM: its engine core and workers started
  and the weights pushed);
- ``update_latency_s``: a real PULSESync patch, verified (``codec/patch.apply_patch`` checks every
  tensor and the digest), handed to ``update(..., changed=names)``, until the first token generated
  on the new weights: one per patch;
- ``tokens_per_s``: generated tokens over wall time of one ``generate`` of ``batch`` completions
  (``prompts`` prompts x ``group_size``, the demo's shape) of ``max_new_tokens`` tokens (no EOS
  stop, so every completion has that length), median of ``repeats``;
- ``rss_mib``: resident memory the engine added: this process's growth plus, for vLLM, its engine
  core and worker processes.

Prints one line per engine and returns the JSON document. The machine's other load is not
controlled: on a shared CPU the figures are what this run saw.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from typing import Any

import torch

from pulsenet import procs
from pulsenet.bench import BenchSettings, config_of


@dataclasses.dataclass(kw_only=True)
class EnginesBenchSettings(BenchSettings):
    model: str = "smollm2"
    """smollm2 or a Hugging Face directory."""
    engines: str = "torch,vllm"
    """Comma-separated engines to measure, each in turn."""
    prompts: int = 4
    """Distinct prompts per batch (the demo's SmolLM2 run: 4)."""
    group_size: int = 4
    """Completions per prompt (the demo's: 4)."""
    max_new_tokens: int = 32
    """Tokens per completion."""
    repeats: int = 3
    """Timed batches per engine (the median is reported)."""
    patches: int = 3
    """Verified updates timed per engine."""
    change_fraction: float = 0.02
    """Entries moved per patch (an RL-sized step: every tensor changes a little)."""


def _tree_rss() -> int:
    me = os.getpid()
    return procs.rss_bytes(me) + sum(procs.rss_bytes(p) for p in procs.descendants(me))


def measure(name: str, s: EnginesBenchSettings) -> dict[str, Any]:
    """One engine's figures (see the module docstring)."""
    from pulsenet.codec.digest import model_digest
    from pulsenet.codec.patch import PatchEncoder, apply_patch
    from pulsenet.engines.base import SamplingParams
    from pulsenet.engines.factory import make_engine
    from pulsenet.engines.gpu_check import next_state
    from pulsenet.nodes.common import initial_model, text_codec
    from pulsenet.rl.models import bf16_state_dict

    codec = text_codec(s.model)
    master = {n: t.detach().float().clone() for n, t in bf16_state_dict(initial_model(s.model)).items()}
    state = {n: t.to(torch.bfloat16) for n, t in master.items()}
    digest = model_digest(state)
    texts = ["The capital of France is", "Question: what is 17 + 25?\nAnswer:", "def fibonacci(n):",
             "Once upon a time, in a small village,"]
    prompts = [codec.encode(texts[i % len(texts)]) for i in range(s.prompts) for _ in range(s.group_size)]
    base = _tree_rss()
    t0 = time.perf_counter()
    engine = make_engine(name, model=s.model, state=state, digest=digest, version=0, codec=codec)
    start_s = time.perf_counter() - t0
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=s.max_new_tokens, stop_at_eos=False, seed=1)
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_new_tokens=2))  # warm
        rates = []
        for _ in range(s.repeats):
            t = time.perf_counter()
            out = engine.generate(prompts, sampling)
            rates.append(sum(len(g.completion_ids) for g in out) / (time.perf_counter() - t))
        rss = _tree_rss() - base
        encoder, gen, latency = PatchEncoder(), torch.Generator().manual_seed(0), []
        first = SamplingParams(temperature=0, max_new_tokens=1)
        for version in range(1, s.patches + 1):
            new = next_state(master, s.change_fraction, gen)
            blob = encoder.encode(state, new, base_digest=digest)
            verified = apply_patch(state, blob, base_digest=digest)
            changed = {n for n in verified if verified[n] is not state[n]}
            state, digest = verified, model_digest(verified)
            t = time.perf_counter()
            engine.update(version, state, digest, changed=changed)
            g = engine.generate(prompts[:1], first)[0]
            latency.append(time.perf_counter() - t)
            assert g.version == version and g.digest == digest
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    return {
        "engine": name,
        "start_s": round(start_s, 2),
        "update_latency_s": [round(x, 3) for x in latency],
        "tokens_per_s": round(statistics.median(rates), 1),
        "tokens_per_s_all": [round(r, 1) for r in rates],
        "rss_mib": round(rss / (1 << 20)),
        "device": getattr(engine, "device_type", None) or str(getattr(engine, "device", "")),
    }


def run(s: EnginesBenchSettings) -> dict[str, Any]:
    results = []
    for name in [e.strip() for e in s.engines.split(",") if e.strip()]:
        r = measure(name, s)
        print(
            f"{name}: start {r['start_s']} s, update->first token {r['update_latency_s']} s, "
            f"{r['tokens_per_s']} tok/s (batch {s.prompts * s.group_size} x {s.max_new_tokens}), RSS +{r['rss_mib']} MiB"
        )
        results.append(r)
    return {
        "bench": "engines",
        "config": config_of(s),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None},
        "torch": torch.__version__,
        "results": results,
    }

