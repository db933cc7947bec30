"""The vLLM engine (extra ``vllm``): an ``AsyncLLM`` on its own event-loop thread, updated in place.

Weights. vLLM's runtime tensors are fused (``qkv_proj``, ``gate_up_proj``) and sharded across
tensor-parallel ranks, so they cannot be hashed against the published digest. The engine keeps a
host mirror of the served BF16 weights in HF coordinates (names of ``rl/models.bf16_state_dict``,
tied ``lm_head`` once): that is what the SHA-256 check covers. An update is checked *before* any
worker sees it: the changed tensors are hashed into the mirror's per-tensor records and the result
must equal the published digest, otherwise nothing is sent. Then only the changed tensors go to
every worker through ``collective_rpc`` and the worker extension (vllm_worker.py) applies them
with the model's own ``load_weights`` in HF coordinates.

Updates and requests (``VLLMEngineConfig.in_flight``):

- ``"wait"`` (default): new requests are held at a gate, requests in flight finish on the old
  weights, then the weights change, the prefix cache is reset and the gate reopens. Every
  completion comes from exactly one version, the one it is labelled with.
- ``"keep"``: ``AsyncLLM.pause_generation(mode="keep")`` freezes requests in flight, the weights
  change, the prefix cache is reset, ``resume_generation()`` continues them on the new weights
  (no wait for long completions; what PipelineRL calls in-flight updates). A completion that
  spans an update is labelled with the version that *started* it (staleness is then counted
  conservatively); its later tokens and their logprobs come from the newer weights, which the
  trainer's importance ratio against the recorded logprobs accounts for. They are counted in
  ``stats.mixed_version_completions``.

Weights from a channel: given ``state`` (a Subscriber's verified weights), vLLM starts with
``load_format="dummy"`` (no checkpoint read: the directory needs only config.json and, for stop
strings, the tokenizer) and the mirror is pushed before the first request. Updates take the names
a verified patch changed (``changed``): only those are compared, hashed and sent.

Either way the prefix cache is reset after every update, so no KV computed by old weights is
reused for a new request. Logprobs: vLLM is run with ``logprobs_mode="processed_logprobs"``,
i.e. after temperature; vLLM applies top-p before it computes them, so the engine refuses
``top_p < 1`` rather than record a distribution other than the one ``Generation`` documents.

vLLM is imported only when an engine is built: this module imports without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch

from pulsenet.codec.digest import model_digest_from_records, tensor_record, tensor_sha256
from pulsenet.codec.dtypes import dtype_name
from pulsenet.engines.base import Engine, EngineStats, Generation, SamplingParams, check_layout, same_bits
from pulsenet.errors import ConfigError, EngineError

WORKER_EXTENSION = "pulsenet.engines.vllm_worker.PulsenetWorkerExtension"
StateDict = Mapping[str, torch.Tensor]
T = TypeVar("T")


def import_vllm() -> Any:
    """The ``vllm`` module, or an EngineError that says how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise EngineError(
            f"the vLLM engine needs vLLM and a CUDA GPU: pip install 'pulsenet[vllm]' ({e})"
        ) from e
    return vllm


@dataclass(kw_only=True, slots=True)
class VLLMEngineConfig:
    in_flight: Literal["wait", "keep"] = "wait"
    """What an update does to requests in flight; see the module docstring."""
    tensor_parallel_size: int = 1
    """GPUs per engine; the worker extension applies updates on every rank."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may take (weights + KV cache)."""
    max_model_len: int | None = None
    """Context limit; None: the model config's."""
    enable_prefix_caching: bool = True
    """Reuse KV across requests with a common prefix (the G copies of a group prompt); reset on every update."""
    enforce_eager: bool = False
    """Skip CUDA graph capture (slower decoding, faster start)."""
    update_timeout_s: float = 600.0
    """Deadline of one update (drain or pause, RPC to all workers, cache reset)."""
    generate_timeout_s: float | None = 3600.0
    """Deadline of one ``generate`` call."""

    def __post_init__(self) -> None:
        if self.in_flight not in ("wait", "keep"):
            raise ConfigError(f"in_flight must be 'wait' or 'keep', got {self.in_flight!r}")
        if self.tensor_parallel_size < 1 or not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError("tensor_parallel_size must be >= 1 and gpu_memory_utilization in (0, 1]")


class HostMirror:
    """The served BF16 weights by HF name, with per-tensor digest records (no vLLM involved).

    ``stage`` finds the changed tensors of an update and checks the digest the mirror *would*
    have; ``commit`` then copies them in. Split so a bad update is refused before any worker sees it.
    """

    def __init__(self, state: StateDict) -> None:
        self.tensors = {n: t.detach().cpu().contiguous().clone() for n, t in state.items()}
        self.records = {n: _record(n, t) for n, t in self.tensors.items()}

    @property
    def digest(self) -> str:
        return model_digest_from_records(self.records)

    def stage(
        self, state: StateDict, digest: str, changed: Set[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
        """Changed tensors (host, contiguous) and their records; EngineError if the result's digest is not ``digest``."""
        check_layout(self.tensors, state)
        # A ``changed`` hint spares comparing the other tensors; a hint that misses a change is
        # caught by the digest check below.
        names = [
            n
            for n in self.tensors
            if (changed is None or n in changed) and not same_bits(self.tensors[n], state[n])
        ]
        tensors = {n: state[n].detach().cpu().contiguous() for n in names}
        records = {n: _record(n, t) for n, t in tensors.items()}
        result = model_digest_from_records({**self.records, **records})
        if result != digest:
            raise EngineError(
                f"update refused: the weights would hash to {result[:16]}…, not the published {digest[:16]}…"
            )
        return tensors, records

    def commit(self, tensors: Mapping[str, torch.Tensor], records: Mapping[str, bytes]) -> None:
        for name, t in tensors.items():
            self.tensors[name].copy_(t)
        self.records.update(records)


class VLLMEngine(Engine):
    """Serves a HF checkpoint directory with vLLM; see the module docstring."""

    def __init__(
        self,
        model_dir: Path,
        config: VLLMEngineConfig | None = None,
        *,
        state: StateDict | None = None,
        version: int | None = None,
        digest: str | None = None,
    ) -> None:
        """``state``/``digest``: the verified BF16 weights to serve (e.g. a Subscriber's); None takes
        the checkpoint's own weights rounded to BF16. Either way they are pushed to the workers once,
        so what runs is exactly the mirror, whatever rounding vLLM's own loader would have done."""
        self.config = config = config or VLLMEngineConfig()
        vllm = import_vllm()
        if not torch.cuda.is_available():
            raise EngineError("the vLLM engine needs a CUDA device; none is visible")
        from_channel = state is not None
        if state is None:
            from pulsenet.rl.models import bf16_state_dict, load_model

            state = bf16_state_dict(load_model(Path(model_dir)))
        self._has_tokenizer = any(
            (Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        )
        self.mirror = HostMirror(state)
        if digest is not None and digest != self.mirror.digest:
            raise EngineError(f"initial weights hash to {self.mirror.digest[:16]}…, not {digest[:16]}…")
        self._version, self._digest = version, self.mirror.digest
        self.stats = EngineStats()
        self._broken: str | None = None
        self._epoch = 0  # bumps on every applied update; a request that sees two epochs spanned one
        self._update_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pulsenet-vllm-loop", daemon=True)
        self._thread.start()
        self._llm: Any = None
        try:
            self._llm = self._run(self._start(vllm, Path(model_dir), from_channel), config.update_timeout_s)
            tensors = {n: t for n, t in self.mirror.tensors.items()}
            self._run(self._swap(tensors), config.update_timeout_s)
        except BaseException:
            self.close()
            raise

    # --- lifecycle -------------------------------------------------------------------------------

    async def _start(self, vllm: Any, model_dir: Path, from_channel: bool) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
        args = AsyncEngineArgs(
            model=str(model_dir),
            dtype="bfloat16",
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=cfg.enforce_eager,
            worker_extension_cls=WORKER_EXTENSION,
            logprobs_mode="processed_logprobs",
            seed=0,
            # Weights from a channel are pushed right after start: reading the directory's would be wasted.
            load_format="dummy" if from_channel else "auto",
            skip_tokenizer_init=not self._has_tokenizer,
        )
        self._gate = asyncio.Event()  # set: requests may start
        self._gate.set()
        self._idle = asyncio.Condition()
        self._in_flight = 0
        self._vllm_sampling = vllm.SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._final_only = RequestOutputKind.FINAL_ONLY  # one output per request, the finished one
        return AsyncLLM.from_engine_args(args)

    def close(self) -> None:
        """Shut vLLM down and stop the loop thread."""
        if self._llm is not None:
            with contextlib.suppress(Exception):
                self._llm.shutdown()
            self._llm = None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError as e:
            future.cancel()
            raise EngineError(f"vLLM did not answer within {timeout} s") from e

    # --- what is served --------------------------------------------------------------------------

    @property
    def version(self) -> int | None:
        return self._version

    @property
    def digest(self) -> str:
        return self._digest

    def served_state(self) -> dict[str, torch.Tensor]:
        """A copy of the host mirror: the served BF16 weights in HF coordinates."""
        return {n: t.clone() for n, t in self.mirror.tensors.items()}

    # --- updates ---------------------------------------------------------------------------------

    def update(
        self,
        version: int,
        state: StateDict,
        digest: str,
        *,
        changed: Set[str] | None = None,
    ) -> None:
        """Blocks until the update is live (or refused: EngineError, the old weights keep serving).

        Call it from a thread other than an event loop you care about: in ``"wait"`` mode it lasts
        as long as the longest request in flight.
        """
        with self._update_lock:
            t0 = time.perf_counter()
            tensors, records = self.mirror.stage(state, digest, changed)
            self._run(self._swap(tensors, version=version, digest=digest), self.config.update_timeout_s)
            self.mirror.commit(tensors, records)
            self.stats.tensors_copied += len(tensors)
            self.stats.bytes_copied += sum(t.numel() * t.element_size() for t in tensors.values())
            self.stats.record_update(time.perf_counter() - t0)

    async def _swap(
        self, tensors: Mapping[str, torch.Tensor], *, version: int | None = None, digest: str | None = None
    ) -> None:
        """Hold new requests, drain or freeze those in flight, load, reset the prefix cache, reopen."""
        llm, keep = self._llm, self.config.in_flight == "keep"
        self._gate.clear()
        try:
            if keep:
                await llm.pause_generation(mode="keep", clear_cache=False)
            else:
                async with self._idle:
                    await self._idle.wait_for(lambda: self._in_flight == 0)
            try:
                if tensors:
                    self._broken = "an update failed while loading weights into the workers"
                    await llm.collective_rpc("pulsenet_load_weights", args=(list(tensors.items()),))
                await self._reset_prefix_cache(keep)
                self._broken = None
                self._epoch += 1
                if digest is not None:
                    self._version, self._digest = version, digest
            finally:
                if keep:
                    await llm.resume_generation()
        finally:
            self._gate.set()

    async def _reset_prefix_cache(self, keep: bool) -> None:
        """Drop every cached KV block computed by the old weights, or fail loudly.

        vLLM refuses the reset (returns False) while a request holds blocks. In ``"wait"`` mode none
        should (blocks of just-finished requests are freed a moment later: retried briefly); in
        ``"keep"`` mode the frozen requests do, so they are reset too (``reset_running_requests``:
        vLLM recomputes their KV from their tokens with the new weights).
        """
        llm = self._llm
        kwargs = {}
        if keep:
            if "reset_running_requests" not in inspect.signature(llm.reset_prefix_cache).parameters:
                raise EngineError(
                    "in_flight='keep' needs a vLLM whose reset_prefix_cache takes reset_running_requests"
                )
            kwargs["reset_running_requests"] = True
        for _ in range(100):
            if await llm.reset_prefix_cache(**kwargs) is not False:  # older vLLM returns None
                return
            await asyncio.sleep(0.02)
        self._broken = "the prefix cache could not be reset after an update: stale KV could be served"
        raise EngineError(self._broken)

    # --- sampling --------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        if self._broken is not None:
            raise EngineError(f"refusing to generate: {self._broken}")
        if params.top_p < 1:
            raise EngineError(
                "the vLLM engine records logprobs after top-p truncation; use top_p=1.0 "
                "(Generation.logprobs are defined before truncation)"
            )
        if any(len(p) == 0 for p in prompts):
            raise EngineError("every prompt needs at least one token")
        if params.stop and not self._has_tokenizer:
            raise EngineError("stop strings need a tokenizer in the model directory")
        t0 = time.perf_counter()
        out = self._run(self._generate(prompts, params), self.config.generate_timeout_s)
        self.stats.generate_s += time.perf_counter() - t0
        self.stats.batches += 1
        self.stats.completions += len(out)
        self.stats.tokens_generated += sum(len(g.completion_ids) for g in out)
        return out

    async def _generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        return list(
            await asyncio.gather(*(self._one(p, params, params.seed + i) for i, p in enumerate(prompts)))
        )

    async def _one(self, prompt: Sequence[int], params: SamplingParams, seed: int) -> Generation:
        await self._gate.wait()
        version, digest, epoch = self._version, self._digest, self._epoch
        self._in_flight += 1
        try:
            sp = self._vllm_sampling(
                n=1,
                temperature=params.temperature,
                top_p=1.0,
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(params.stop_token_ids),
                stop=list(params.stop) or None,
                include_stop_str_in_output=True,
                ignore_eos=not params.stop_at_eos,
                logprobs=0,  # the sampled token's own logprob only
                seed=seed,
                detokenize=bool(params.stop),  # stop strings are matched on text
                output_kind=self._final_only,
            )
            final = None
            async for out in self._llm.generate(
                {"prompt_token_ids": list(prompt)}, sp, request_id=f"pulsenet-{uuid.uuid4().hex}"
            ):
                final = out
        finally:
            self._in_flight -= 1
            async with self._idle:
                self._idle.notify_all()
        if final is None or not final.outputs:
            raise EngineError("vLLM returned no output for a request")
        if self._epoch != epoch:
            self.stats.mixed_version_completions += 1
        c = final.outputs[0]
        ids = tuple(int(t) for t in c.token_ids)
        logprobs = tuple(float(pos[tok].logprob) for pos, tok in zip(c.logprobs, ids, strict=True))
        if c.finish_reason not in ("stop", "length"):
            raise EngineError(f"vLLM ended a request with {c.finish_reason!r}")
        return Generation(
            prompt_ids=tuple(int(x) for x in prompt),
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            version=version,
            digest=digest,
            seed=seed,
        )


def _record(name: str, t: torch.Tensor) -> bytes:
    return tensor_record(name, dtype_name(t.dtype), t.shape, tensor_sha256(t))


__all__ = ["WORKER_EXTENSION", "HostMirror", "VLLMEngine", "VLLMEngineConfig", "import_vllm"]
