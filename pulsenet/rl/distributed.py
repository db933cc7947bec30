"""Scale inside a trainer site: a rank group, FSDP2 data-parallel inner steps over ``torch.distributed``,
rank 0 speaking for the group.

A trainer site with N GPUs is launched with ``torchrun --nproc-per-node N``. Its model is sharded
with FSDP2 (``rl.sharding``): each rank holds a 1/N chunk of every FP32 master weight, of every
gradient and of the AdamW moments, and steps on its share of each batch; the backward's
reduce-scatter sums the ranks' gradients, so the rank group takes the whole batch's step. Rank 0 is the
group's voice: it holds a :class:`RankGroup` and runs the PULSELoCo round (``LocoTrainer``, with a
:class:`GroupInner` or :class:`GroupGRPOInner` as its inner loop) and PULSESync publishing exactly
as a single-process trainer would; ranks > 0 run :func:`serve_rank` and only do what rank 0 tells
them over the process group::

    ("init",)         rank 0's weights (and GRPO's frozen reference weights) follow; then every
                      rank shards its model: one θ for the group
    ("train", H)      H supervised data-parallel steps on ``batch_of(step)`` (rank 0 takes them too)
    ("grpo", rows)    one GRPO step on this rollout batch (only rank 0 reads rollouts from the store)
    ("load",)         new FP32 weights follow, one broadcast per tensor in name order
    ("read", what)    gather the whole weights / BF16 weights / checkpoint / resume point: every
                      rank holds a chunk, rank 0 keeps the result (``RankGroup.state_fp32`` & co.)
    ("restore", s)    optimizer / RNG / step state s (a resume point), so every rank continues alike
    ("stop",)         leave serve_rank

Commands go out with ``broadcast_object_list`` (small pickles from rank 0, which the other ranks
trust: they are one job; a GRPO batch is a few hundred KB of token ids); weights with
``broadcast`` of the tensors themselves. ``RankGroup`` sends each command and its collectives under
one lock, so a command from the round's worker thread and a ``stop`` from the main thread never
interleave on the wire. On a sharded rank group every read of the whole model is a collective, so rank
0 reads through its ``RankGroup`` (``state_fp32``, ``bf16_state``, ``checkpoint``, ``resume_state``);
a read through the ``LocalTrainer`` directly, which alone would wait forever for the other ranks,
raises RuntimeError instead (``LocalTrainer.read_guard``, while the rank group runs).

The step. Each rank computes the loss of its shares of the batch, rows ``rank::world``, each
normalised by the *whole* batch's count (valid tokens; GRPO's completion tokens T), so the sum of
the ranks' gradients is the gradient of the whole batch's mean loss (a plain per-rank mean
followed by an average would weight tokens unevenly when the ranks' rows hold different numbers
of tokens). FSDP2 sums them in the backward's reduce-scatter (on the last micro-batch of the rank:
:meth:`DataParallel.before_backward`); the clipping norm is taken over the chunks
(:meth:`DataParallel.chunk_norms`); then the one AdamW step, each rank on its chunks (:func:`sft_step`,
``GRPOTrainer.step``). For the supervised steps the batch of step s is a function of s
(``batch_of(step)``), so every rank builds it itself; a GRPO batch is rollouts only rank 0
downloaded, so it travels with the command.

Bit-exactness. FP32 addition is not associative, so the distributed step cannot equal a plain
single-process step on the whole batch to the bit. It equals, to the bit, the single-process
*reference* (``DataParallel(reference_world=2)``, ``RankGroup(..., reference_world=2)``) that computes
the same per-rank gradients in rank order, keeps them apart, sums them, and takes the clipping
norm chunk by chunk as the shards hold it: with 2 ranks the reduce-scatter is a single FP32
addition ``g0 + g1`` per element, which is commutative, so every rank's chunk is exactly the
reference's. With more than 2 ranks the ranks still agree with each other, but the backend's
reduction order (gloo's ring, NCCL's trees) need not be the reference's left-to-right one.

Memory per rank (P parameters): FP32 weights, gradients and both AdamW moments are 16P bytes on
one process, 16P/N here at rest; during a step's forward and backward each rank also holds the
gathered full FP32 weights (4P: ``reshard_after_forward=False``, which the BF16-rounding forward
needs, see ``rl.sharding``) and the frozen KL reference model (4P when ``beta > 0``), which is not
sharded.

Backends (:func:`init_rank_group`): ``gloo`` on a CPU-only host (what the tests run); with CUDA,
``cpu:gloo,cuda:nccl``, so collectives on CUDA tensors go over NCCL and the small CPU ones over
gloo. Which one a collective takes follows its tensors: with ``device = "cuda"``
(``TrainerConfig.device``; each rank on ``cuda:LOCAL_RANK``, set by :func:`init_rank_group`) FSDP2's
all-gathers and reduce-scatters and the weight broadcasts run on the parameters' device, so over
NCCL; the commands (``broadcast_object_list(device=cpu)``), the clipping norms and the step's
metric sums are CPU tensors, so over gloo. With ``device = "cpu"`` on a GPU host everything runs
on gloo. The NCCL half was never run here (no GPU).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pulsenet.codec.rollout import Rollout
from pulsenet.rl.grpo import GRPOMetrics, GRPOTrainer
from pulsenet.rl.inner import GRPOInner, LocalInner, _checkpoint, _restore
from pulsenet.rl.local import LocalTrainer
from pulsenet.rl.parallel import DataParallel
from pulsenet.rl.tasks import IGNORE_INDEX

Batch = tuple[torch.Tensor, torch.Tensor]
BatchOf = Callable[[int], Batch]
"""``batch_of(step) -> (input_ids, labels)``: the whole batch of a step, the same on every rank."""

GROUP_TIMEOUT = timedelta(days=1)
"""Deadline of one collective. Ranks > 0 wait for rank 0's next command inside a broadcast, and a
lone trainer may wait for rollouts for as long as the inference nodes are down: a short timeout
would kill an idle rank group. A rank that dies is noticed at once anyway (gloo and NCCL see the
connection drop, torchrun sees the exit); a rank 0 that hangs is what its /healthz reports."""

_CPU = torch.device("cpu")


# --- the process group --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TorchrunRank:
    """This process's place in a ``torchrun`` job."""

    rank: int
    world: int
    local_rank: int


def torchrun_rank(env: Mapping[str, str]) -> TorchrunRank | None:
    """``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` as torchrun sets them; None outside torchrun."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    return TorchrunRank(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])))


def init_rank_group(rank: TorchrunRank) -> str:
    """Join the rank group's process group (torchrun's ``MASTER_ADDR``/``MASTER_PORT`` rendezvous); the backend."""
    backend = "gloo"
    if torch.cuda.is_available():  # never run here: no GPU
        torch.cuda.set_device(rank.local_rank)
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend, rank=rank.rank, world_size=rank.world, timeout=GROUP_TIMEOUT)
    return backend


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank process now, after ``destroy_process_group``, skipping interpreter finalization.

    Why: the process group outlives ``destroy_process_group`` while anything else still holds it
    (FSDP2's device mesh does), and gloo's worker threads may then hold work with Python tensors;
    tearing those down during interpreter finalization aborts the process ("terminate called
    without an active exception", SIGABRT; pytorch PR 179291), so torchrun fails a job whose every
    step and publication had succeeded. Logs and stdio are flushed first; nothing else is pending
    in a rank once its group is destroyed (rank 0 has closed its node: store, files, status)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# --- the data-parallel step ---------------------------------------------------------------------


def valid_tokens(labels: torch.Tensor) -> int:
    """Tokens the causal LM loss counts in a batch (the shifted labels that are not ignored)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def shard_loss(local: LocalTrainer, batch: Batch, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of the whole batch's mean loss: its rows' token-loss sum / the batch's count."""
    input_ids, labels = batch
    count = max(valid_tokens(labels), 1)
    ids, lab = input_ids[rank::world], labels[rank::world].to(local.device)
    logits = local.logits(ids)[:, :-1, :].float()
    total = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        lab[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return total / count


def sft_step(local: LocalTrainer, batch: Batch, dp: DataParallel) -> float:
    """One supervised optimizer step on this process's shares of ``batch``, gradients summed over
    the rank group; the whole batch's loss (the same float on every rank)."""
    local.model.train()
    local.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros(())
    for rank in dp.shares:
        loss = shard_loss(local, batch, rank, dp.world)
        dp.before_backward(local.model, last=True)
        loss.backward()
        total = total + loss.detach().cpu()  # metrics are summed on the CPU (gloo)
        dp.share_done(local.model)
    dp.sum_gradients(local.model)
    total = dp.sum_metrics(total)
    local.apply_gradients(dp.chunk_norms)
    return float(total)


# --- rank 0: the rank group's voice -------------------------------------------------------------------


class RankGroup:
    """Rank 0's handle on the rank group: every call that changes or reads the whole model runs on every rank.

    Give it the ``GRPOTrainer`` (the trainer daemon) or the ``LocalTrainer`` and its ``batch_of``
    (supervised), before their first step. On construction rank 0's weights go to every rank and
    every rank shards its model (FSDP2), so the rank group starts from one θ whatever the other ranks
    loaded. ``reference_world=W`` makes the single-process reference
    instead: the same steps as a group of W ranks, no process group. Call :meth:`stop` when done, so
    that the other ranks leave :func:`serve_rank`; calls after it raise.
    """

    def __init__(
        self,
        local: LocalTrainer | None = None,
        *,
        grpo: GRPOTrainer | None = None,
        batch_of: BatchOf | None = None,
        group: dist.ProcessGroup | None = None,
        reference_world: int | None = None,
    ) -> None:
        if grpo is not None and local is None:
            local = grpo.local
        elif grpo is not None or local is None:
            raise ValueError("RankGroup needs a LocalTrainer (supervised) or a GRPOTrainer, not both")
        self.grpo, self.batch_of, self.group = grpo, batch_of, group
        self.local: LocalTrainer = local
        self.dp = DataParallel(group, reference_world=reference_world)
        if grpo is not None:
            grpo.parallel = self.dp
        self._lock = threading.Lock()
        self._speaker: int | None = None  # the thread holding the lock
        self._stopped = False
        if not self.dp.reference:
            if dist.get_rank(group) != 0:
                raise ValueError("RankGroup runs on rank 0; the other ranks run serve_rank")
            with self._speaking():
                self._send("init")
                _init_weights(self.local, self.grpo, group)
            self.local.read_guard = self._check_reader

    @property
    def world(self) -> int:
        return self.dp.world

    @contextlib.contextmanager
    def _speaking(self) -> Iterator[None]:
        """The rank group's lock, held by this thread: a command and the collectives that follow it go out
        together, and whole-model reads of the sharded trainer are allowed here only."""
        with self._lock:
            self._speaker = threading.get_ident()
            try:
                yield
            finally:
                self._speaker = None

    def _check_reader(self) -> None:
        """``LocalTrainer.read_guard`` on rank 0: a read of the whole sharded model outside the rank group
        would wait forever for ranks that are waiting for a command."""
        if not self._stopped and self._speaker != threading.get_ident():
            raise RuntimeError(
                "this trainer is sharded over a rank group: read its whole weights or checkpoint through "
                "its rl.distributed.RankGroup (state_fp32, bf16_state, checkpoint, resume_state), so that "
                "every rank takes part"
            )

    def _send(self, *cmd: Any) -> None:
        """Hold ``self._lock``: the command and the collectives that follow it go out together."""
        if self._stopped:
            raise RuntimeError("the rank group was stopped: its other ranks are gone")
        if not self.dp.reference:
            dist.broadcast_object_list([cmd], src=0, group=self.group, device=_CPU)

    def train(self, steps: int) -> list[float]:
        """``steps`` supervised steps on ``batch_of(step)``."""
        with self._speaking():
            self._send("train", steps)
            return _train(self.local, self.batch_of, steps, self.dp)

    def grpo_step(self, rollouts: Sequence[Rollout]) -> GRPOMetrics:
        """One ``GRPOTrainer.step`` on every rank; the batch goes with the command."""
        assert self.grpo is not None, "a supervised rank group has no GRPO step"
        with self._speaking():
            self._send("grpo", list(rollouts))
            return self.grpo.step(rollouts)

    def load_state_fp32(self, state: Mapping[str, torch.Tensor]) -> None:
        """New FP32 weights on every rank (rank 0 checks them first: a bad state raises here, before
        any rank is told)."""
        with self._speaking():
            self.local.load_state_fp32(dict(state))
            if not self.dp.reference:
                self._send("load")
                _broadcast_state(self.local, state, self.group)

    def state_fp32(self) -> dict[str, torch.Tensor]:
        """``LocalTrainer.state_fp32``: the whole FP32 weights on the CPU (gathered from every rank)."""
        return self._read("state_fp32")

    def bf16_state(self) -> dict[str, torch.Tensor]:
        """``LocalTrainer.bf16_state``: what PULSESync publishes."""
        return self._read("bf16_state")

    def checkpoint(self) -> dict[str, Any]:
        """``LocalTrainer.checkpoint``: weights, optimizer (moments gathered whole), RNG, steps."""
        return self._read("checkpoint")

    def resume_state(self) -> dict[str, Any]:
        """An inner loop's resume point: optimizer, RNG and step counter (``InnerLoop.checkpoint``)."""
        return self._read("resume_state")

    def _read(self, what: str) -> Any:
        """A read of the whole model: on every rank at once (each holds a shard of it), rank 0's kept."""
        with self._speaking():
            if not self.dp.reference:
                self._send("read", what)
            return _READS[what](self.local)

    def restore(self, state: Mapping[str, Any]) -> None:
        """A resume point's optimizer, RNG and step counter (``{"optimizer", "rng", "steps"}``)."""
        with self._speaking():
            _restore(self.local, state)
            self._send("restore", {k: state[k] for k in ("optimizer", "rng", "steps")})

    def restore_checkpoint(self, checkpoint: Mapping[str, Any]) -> None:
        """``LocalTrainer.restore`` on every rank: weights, then optimizer, RNG and step counter."""
        self.load_state_fp32(checkpoint["weights"])
        self.restore(checkpoint)

    def stop(self) -> None:
        """Release the other ranks (once; waits for a command in flight to finish)."""
        with self._speaking():
            if not self._stopped:
                self._send("stop")
                self._stopped = True


class _SpokenFor(LocalInner):
    """An inner loop whose weight and resume-state changes go through its rank group to every rank."""

    ranks: RankGroup

    def load_state_fp32(self, state: Mapping[str, torch.Tensor]) -> None:
        self.ranks.load_state_fp32(state)

    def state_fp32(self) -> dict[str, torch.Tensor]:
        return self.ranks.state_fp32()

    def parameters(self) -> Mapping[str, torch.Tensor]:
        """A snapshot gathered from the shards (what a GPU trainer hands the round too: ``LocalInner``)."""
        return self.ranks.state_fp32() if self.ranks.local.sharded else super().parameters()

    def checkpoint(self) -> dict[str, Any]:
        return self.ranks.resume_state()

    def restore(self, state: Mapping[str, Any]) -> None:
        self.ranks.restore(state)

    def stop(self) -> None:
        self.ranks.stop()


class GroupInner(_SpokenFor, LocalInner):
    """The supervised ``InnerLoop`` of a rank group, on rank 0 (``reference_world``: see :class:`RankGroup`)."""

    def __init__(
        self,
        local: LocalTrainer,
        batch_of: BatchOf,
        *,
        group: dist.ProcessGroup | None = None,
        reference_world: int | None = None,
    ) -> None:
        self.local = local
        self.ranks = RankGroup(local, batch_of=batch_of, group=group, reference_world=reference_world)

    def train(self, steps: int) -> list[float]:
        return self.ranks.train(steps)


class GroupGRPOInner(_SpokenFor, GRPOInner):
    """``GRPOInner`` of a rank group, on rank 0: each step, weight read and checkpoint runs on every rank."""

    def __init__(self, ranks: RankGroup) -> None:
        assert ranks.grpo is not None
        super().__init__(ranks.grpo)
        self.ranks = ranks

    def step(self, batch: Sequence[Rollout]) -> GRPOMetrics:
        return self.ranks.grpo_step(batch)

    def bf16_state(self) -> dict[str, torch.Tensor]:
        return self.ranks.bf16_state()

    def full_checkpoint(self) -> dict[str, Any]:
        return self.ranks.checkpoint()

    def restore_full(self, checkpoint: Mapping[str, Any]) -> None:
        self.ranks.restore_checkpoint(checkpoint)


# --- ranks > 0 ----------------------------------------------------------------------------------


def serve_rank(
    local: LocalTrainer | None = None,
    batch_of: BatchOf | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    grpo: GRPOTrainer | None = None,
) -> None:
    """Ranks > 0: do what rank 0's :class:`RankGroup` says until it says stop."""
    dp = DataParallel(group)
    if grpo is not None:
        grpo.parallel, local = dp, grpo.local
    assert local is not None
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group, device=_CPU)
        cmd = box[0]
        if cmd[0] == "init":
            _init_weights(local, grpo, group)
        elif cmd[0] == "read":
            _READS[cmd[1]](local)  # this rank's part of the gather; rank 0 keeps the result
        elif cmd[0] == "train":
            _train(local, batch_of, int(cmd[1]), dp)
        elif cmd[0] == "grpo":
            assert grpo is not None, "rank 0 sent a GRPO step to a supervised rank"
            grpo.step(cmd[1])
        elif cmd[0] == "load":
            _broadcast_state(local, None, group)
        elif cmd[0] == "restore":
            _restore(local, cmd[1])
        elif cmd[0] == "stop":
            return
        else:
            raise ValueError(f"unknown rank group command {cmd[0]!r}")


def _train(local: LocalTrainer, batch_of: BatchOf | None, steps: int, dp: DataParallel) -> list[float]:
    assert batch_of is not None, "a GRPO rank group has no supervised batches"
    losses = [sft_step(local, batch_of(local.steps), dp) for _ in range(steps)]
    local.optimizer.zero_grad(set_to_none=True)  # free the gradients between rounds
    return losses


_READS: dict[str, Callable[[LocalTrainer], Any]] = {
    "state_fp32": LocalTrainer.state_fp32,
    "bf16_state": LocalTrainer.bf16_state,
    "checkpoint": LocalTrainer.checkpoint,
    "resume_state": _checkpoint,
}
"""What ``RankGroup._read`` may ask every rank to take part in."""


def _init_weights(local: LocalTrainer, grpo: GRPOTrainer | None, group: dist.ProcessGroup | None) -> None:
    """Rank 0's weights (and GRPO's frozen KL reference, which stays whole on every rank) to every
    rank, then every rank shards the trained model (FSDP2, ``rl.sharding``)."""
    with torch.no_grad():
        for _, p in sorted(local.model.named_parameters()):
            dist.broadcast(p.data, src=0, group=group)
        if grpo is not None and grpo.reference is not None:
            for _, p in sorted(grpo.reference.model.named_parameters()):
                dist.broadcast(p.data, src=0, group=group)
    local.shard(group)


def _broadcast_state(local: LocalTrainer, state: Mapping[str, torch.Tensor] | None, group: dist.ProcessGroup | None) -> None:
    """Rank 0's whole FP32 ``state`` (None on the other ranks, which load it) to every rank, one
    tensor at a time in name order; each rank keeps its chunks."""
    received: dict[str, torch.Tensor] = {}
    for name, p in sorted(local.model.named_parameters()):
        if state is None:
            t = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        else:
            t = state[name].to(p.device, torch.float32).contiguous()
        dist.broadcast(t, src=0, group=group)
        received[name] = t
    if state is None:
        local.load_state_fp32(received)
