"""The default engine: a transformers causal LM, batched sampling with a KV cache, in-place updates.

Weights: the engine serves exactly the verified BF16 values. On CUDA the model runs in BF16; on
CPU it runs in FP32 on ``fp32(bf16(w))`` (BF16 matmuls are very slow on CPUs without AVX512-BF16,
and the widening is exact, so the served weights are still bit-for-bit the BF16 ones). The engine
holds no other copy: an update is compared against the parameters themselves, each narrowed to
BF16 one tensor at a time (a host mirror would cost 2 more bytes per parameter, beside the verified
BF16 state the node's subscriber already holds); the digest is always recomputed from the model's
own parameters, never from the caller's tensors.

Updates (``update``) are applied in place between batches: a ``threading.Lock`` is held for a whole
batch; an update that cannot take it is parked in a one-slot pending box (newest wins) and applied
by the generating thread right after its batch, or at the start of the next ``generate``. Only
tensors whose bits changed are copied, and only those are rehashed: the per-tensor records of the
others still describe the untouched parameters. If the result does not hash to the published
digest the engine refuses to generate (EngineError) until an update repairs it.

Sampling (``generate``): prompts are left-padded into one batch with an attention mask and
explicit position ids, then decoded one token per step over ``past_key_values``. Each completion
draws with the public draw (rl/draw.py: its key's PRF uniforms, inverse CDF in token-id order over
the top-p nucleus), so draws are reproducible, independent of batch composition, the same rule as
the vLLM engine's, and replayable by a trainer (rl/replay.py).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from pulsenet.codec.digest import model_digest_from_records, tensor_record, tensor_sha256
from pulsenet.codec.dtypes import dtype_name
from pulsenet.engines.base import (
    Engine,
    EngineStats,
    Generation,
    SamplingParams,
    check_layout,
    draw_token,
    same_bits,
)
from pulsenet.errors import ConfigError, EngineError
from pulsenet.rl.draw import uniform
from pulsenet.rl.models import unique_state_dict

StateDict = Mapping[str, torch.Tensor]
log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class TorchEngineConfig:
    device: str = "auto"
    """``"auto"``: CUDA when available, else CPU; or any torch device string."""
    compute_dtype: str = "auto"
    """``"auto"``: BF16 on CUDA, FP32 (on the BF16 values) elsewhere; or ``"bfloat16"``/``"float32"``."""
    max_batch: int | None = None
    """Split larger ``generate`` calls into batches of this many prompts (None: one batch)."""
    verify_updates: bool = True
    """Rehash the changed parameters after each update and check the published digest."""
    hash_threads: int = 2
    """Threads for SHA-256 of the weights."""

    def __post_init__(self) -> None:
        if self.compute_dtype not in ("auto", "bfloat16", "float32"):
            raise ConfigError(f"compute_dtype must be auto, bfloat16 or float32, got {self.compute_dtype!r}")
        if self.max_batch is not None and self.max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1 or None, got {self.max_batch}")


@dataclass(slots=True)
class _Pending:
    version: int | None
    state: StateDict
    digest: str
    changed: Set[str] | None


class TorchEngine(Engine):
    """Serves a transformers causal LM; see the module docstring. Takes ownership of ``model``."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: TorchEngineConfig | None = None,
        *,
        version: int | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """``model`` (any dtype) is rounded to BF16 and served as ``version``; its digest is computed.
        ``decode``: ids to text (``TextCodec.decode``), needed for ``SamplingParams.stop`` strings."""
        self.config = config = config or TorchEngineConfig()
        self.decode = decode
        device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        if config.compute_dtype == "auto":
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        else:
            dtype = getattr(torch, config.compute_dtype)
        self.device, self.dtype = device, dtype
        self.stats = EngineStats()
        with torch.no_grad():
            for t in model.state_dict().values():  # round first: fp32(bf16(w)) is what BF16 sees
                if t.is_floating_point():
                    t.copy_(t.to(torch.bfloat16))
            model.to(device=device, dtype=dtype)
        model.eval()
        self.model = model
        self._params = {n: t for n, t in unique_state_dict(model).items()}
        self._layout = {  # names, shapes and served dtypes, no memory: what an update must match
            n: torch.empty(t.shape, dtype=torch.bfloat16 if t.is_floating_point() else t.dtype, device="meta")
            for n, t in self._params.items()
        }
        self._records: dict[str, bytes] = {}
        for name in self._params:
            self._rehash(name)
        self._version = version
        self._digest = model_digest_from_records(self._records)
        self._broken: str | None = None
        self._unhashed: set[str] = set()  # copied while verify_updates was off
        eos = model.config.eos_token_id
        self.eos_ids: tuple[int, ...] = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        # transformers >= 5.2x names the KV cache ``cache``; older releases ``past_key_values``.
        self._cache_arg = (
            "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        )
        self._lock = threading.Lock()  # held for a whole batch and for an update
        self._pending_lock = threading.Lock()
        self._pending: _Pending | None = None

    # --- construction --------------------------------------------------------------------------

    @classmethod
    def from_state(
        cls,
        hf_config: PretrainedConfig,
        state: StateDict,
        digest: str,
        *,
        version: int | None = None,
        config: TorchEngineConfig | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> TorchEngine:
        """An engine serving a verified BF16 state dict (e.g. a Subscriber's first ``on_update``)."""
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        engine = cls(model, config, decode=decode)
        engine._apply(_Pending(version, state, digest, None))
        return engine

    @classmethod
    def from_pretrained(
        cls,
        path: Path,
        *,
        version: int | None = None,
        config: TorchEngineConfig | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> TorchEngine:
        """An engine on a local HF directory (``rl/models.save_model``, ``smollm2_checkpoint``)."""
        model = AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32, local_files_only=True)
        return cls(model, config, version=version, decode=decode)

    # --- what is served ------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def digest(self) -> str:
        return self._digest

    def weights_digest(self) -> str:
        """Model digest recomputed from every parameter the model runs with (slow: hashes it all)."""
        records = {
            n: tensor_record(n, dtype_name(torch.bfloat16), t.shape, tensor_sha256(self._as_bf16(t).cpu()))
            if t.is_floating_point()
            else tensor_record(n, dtype_name(t.dtype), t.shape, tensor_sha256(t.cpu()))
            for n, t in self._params.items()
        }
        return model_digest_from_records(records)

    def served_state(self) -> dict[str, torch.Tensor]:
        """A copy of the served BF16 weights by name (HF coordinates, tied ``lm_head`` once)."""
        return {n: self._served(n, copy=True) for n in self._params}

    def close(self) -> None:
        """Nothing to release: the model is memory, freed with the engine."""

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The compute copy: the model's parameters in ``compute_dtype`` (FP32 on the CPU)."""
        return {f"engine_{dtype_name(self.dtype)}": [t for t in self._params.values() if t.device.type == "cpu"]}

    # --- updates -------------------------------------------------------------------------------

    def update(
        self,
        version: int,
        state: StateDict,
        digest: str,
        *,
        changed: Set[str] | None = None,
    ) -> None:
        """Apply now if no batch is running, else when it ends (see the module docstring).

        Raises EngineError (nothing changed) if ``state`` does not have the served names, shapes and
        dtypes, and EngineError after applying if the result does not hash to ``digest``.
        """
        with self._pending_lock:
            if self._pending is not None:
                self.stats.superseded_updates += 1
            self._pending = _Pending(version, state, digest, changed)
        if self._lock.acquire(blocking=False):
            try:
                self._apply_pending()
            finally:
                self._lock.release()
        else:
            self.stats.deferred_updates += 1

    def _apply_pending(self, *, deferred: bool = False) -> None:
        """Apply the parked update, if any. Caller holds ``self._lock``.

        ``deferred``: the update's caller has returned already, so a failure is logged and counted
        instead of raised into an unrelated ``generate`` (a digest failure still stops generation).
        """
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            self._apply(pending)
        except EngineError as e:
            if not deferred:
                raise
            self.stats.updates_failed += 1
            log.error(
                "deferred update to v%s failed, still serving v%s: %s", pending.version, self._version, e
            )

    def _apply(self, up: _Pending) -> None:
        t0 = time.perf_counter()
        check_layout(self._layout, up.state)
        # A ``changed`` hint spares comparing the other tensors; a hint that misses a change cannot
        # slip through, because the digest over the parameters then differs from the published one.
        hint = up.changed if self.config.verify_updates else None
        candidates = [n for n in self._params if hint is None or n in hint]
        changed = [n for n in candidates if not same_bits(self._served(n), up.state[n])]
        with torch.no_grad():
            for name in changed:
                self._params[name].copy_(up.state[name].to(self.device, non_blocking=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.config.verify_updates:
            for name in {*changed, *self._unhashed}:
                self._rehash(name)
            self._unhashed.clear()
            digest = model_digest_from_records(self._records)
            if digest != up.digest:
                self._broken = (
                    f"after applying v{up.version} the served weights hash to {digest[:16]}…, "
                    f"not the published {up.digest[:16]}…"
                )
                raise EngineError(self._broken)
        else:
            self._unhashed.update(changed)  # rehashed by the next verified update
            digest = up.digest
        self._broken = None
        self._version, self._digest = up.version, digest
        self.stats.tensors_copied += len(changed)
        self.stats.bytes_last_update = sum(up.state[n].numel() * up.state[n].element_size() for n in changed)
        self.stats.bytes_copied += self.stats.bytes_last_update
        self.stats.record_update(time.perf_counter() - t0)

    def _rehash(self, name: str) -> None:
        t = self._params[name]
        if t.is_floating_point():
            t = self._as_bf16(t)
        t = t.detach().cpu().contiguous()
        self._records[name] = tensor_record(name, dtype_name(t.dtype), t.shape, tensor_sha256(t))

    def _served(self, name: str, *, copy: bool = False) -> torch.Tensor:
        """One parameter as served, on the host: BF16 (or its own dtype if not floating); ``copy``:
        never the parameter's own memory."""
        t = self._params[name].detach()
        dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
        return t.to("cpu", dtype, copy=copy).contiguous()

    @staticmethod
    def _as_bf16(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach()

    @torch.no_grad()
    def score(
        self, prompt: Sequence[int], completion: Sequence[int], temperature: float = 1.0
    ) -> list[float]:
        """Log-prob of each completion token after ``prompt`` under ``log_softmax(logits / T)``,
        from one full forward without a cache (a reference for the sampler and for other engines)."""
        with self._lock:
            ids = torch.tensor([[*prompt, *completion]], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
            return logp.gather(1, ids[0, len(prompt) :, None])[:, 0].tolist()

    # --- sampling ------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        if any(len(p) == 0 for p in prompts):
            raise EngineError("every prompt needs at least one token")
        if params.stop and self.decode is None:
            raise EngineError("stop strings need the engine's decode (TorchEngine(..., decode=codec.decode))")
        out: list[Generation] = []
        step = self.config.max_batch or max(len(prompts), 1)
        for start in range(0, len(prompts), step):
            with self._lock:
                self._apply_pending(deferred=True)
                if self._broken is not None:
                    raise EngineError(f"refusing to generate: {self._broken}")
                t0 = time.perf_counter()
                batch = self._generate_batch(prompts[start : start + step], params, start)
                self.stats.generate_s += time.perf_counter() - t0
            out += batch
            self.stats.batches += 1
            self.stats.completions += len(batch)
            self.stats.tokens_generated += sum(len(g.completion_ids) for g in batch)
        # An update parked during the batch goes in now, between batches, not at the next call.
        if self._pending is not None and self._lock.acquire(blocking=False):
            try:
                self._apply_pending(deferred=True)
            finally:
                self._lock.release()
        return out

    def _forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, past: object
    ) -> tuple[torch.Tensor, object]:
        """Logits of the last position in FP32, and the grown KV cache."""
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_arg: past},
        )
        return out.logits[:, -1, :].float(), getattr(out, self._cache_arg)

    @torch.no_grad()
    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, offset: int
    ) -> list[Generation]:
        n = len(prompts)
        width = max(len(p) for p in prompts)
        limit = getattr(self.model.config, "max_position_embeddings", None)
        if limit is not None and width + params.max_new_tokens > limit:
            raise EngineError(
                f"prompt ({width} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"model's {limit} positions"
            )
        pad = 0
        ids = torch.full((n, width), pad, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        seeds = [params.seed + offset + i for i in range(n)]
        keys = params.draw_keys(n, offset)
        stop = torch.tensor(
            sorted(set(params.stop_token_ids) | (set(self.eos_ids) if params.stop_at_eos else set())),
            dtype=torch.long,
            device=self.device,
        )
        tokens = torch.empty((n, params.max_new_tokens), dtype=torch.long, device=self.device)
        logps = torch.empty((n, params.max_new_tokens), dtype=torch.float32, device=self.device)
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        lengths = torch.full((n,), params.max_new_tokens, dtype=torch.long, device=self.device)
        past = None
        steps = 0
        texts = _StopStrings(params.stop, self.decode, n) if params.stop else None
        for t in range(params.max_new_tokens):
            logits, past = self._forward(ids, mask, positions, past)
            tok, lp = _sample(logits, params, [uniform(k, t) for k in keys])
            tokens[:, t], logps[:, t] = tok, lp
            steps = t + 1
            hit = torch.isin(tok, stop) & ~done
            if texts is not None:
                hit |= texts.step(tok.tolist(), done.tolist()).to(hit.device) & ~done
            lengths = torch.where(hit, t + 1, lengths)
            done |= hit
            if bool(done.all()):
                break
            ids = tok[:, None]
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
        tokens, logps, lengths, done = (
            tokens[:, :steps].cpu(),
            logps[:, :steps].cpu(),
            lengths.cpu(),
            done.cpu(),
        )
        out = []
        for i, p in enumerate(prompts):
            k = int(lengths[i])
            out.append(
                Generation(
                    prompt_ids=tuple(int(x) for x in p),
                    completion_ids=tuple(tokens[i, :k].tolist()),
                    logprobs=tuple(logps[i, :k].tolist()),
                    finish_reason="stop" if bool(done[i]) else "length",
                    version=self._version,
                    digest=self._digest,
                    seed=seeds[i],
                )
            )
        return out


class _StopStrings:
    """Per-row text stop: after each token, decode the row's last few tokens and look for a stop string.

    A stop string of L characters is completed by the newest token and lies within the last
    2L + 4 tokens (a token decodes to at least one character, except pieces of a multi-byte
    character), so decoding that window each step finds it the step it appears, in O(L) per row.
    """

    def __init__(self, stop: tuple[str, ...], decode: Callable[[Sequence[int]], str], n: int) -> None:
        self.stop, self.decode = stop, decode
        self.window = 2 * max(len(s) for s in stop) + 4
        self.rows: list[list[int]] = [[] for _ in range(n)]

    def step(self, tokens: list[int], done: list[bool]) -> torch.Tensor:
        hit = torch.zeros(len(tokens), dtype=torch.bool)
        for i, (t, d) in enumerate(zip(tokens, done, strict=True)):
            if d:
                continue
            row = self.rows[i]
            row.append(t)
            tail = self.decode(row[-self.window :])
            hit[i] = any(s in tail for s in self.stop)
        return hit


def _sample(logits: torch.Tensor, params: SamplingParams, u: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row by the public draw (``engines.base.draw_token``: the rule ``rl.draw.choose``
    for the row's uniform) and its log-prob under ``log_softmax(logits / T)`` (before top-p; greedy: T = 1)."""
    return draw_token(logits, u, params.temperature, params.top_p)
