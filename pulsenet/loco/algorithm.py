"""The PULSELoCo algorithm as pure functions (PULSE, arXiv 2602.03839, sparse DiLoCo).

One round, read top to bottom, for every trainer k starting from the same global FP32 weights θ:

1. H inner AdamW steps from θ give the local weights θ_k (``LocalTrainer``; not in this module).
2. Pseudo-gradient with error feedback: ``s_k = e_k + (θ - θ_k)``          (:func:`pseudo_gradient`)
3. Visibility gate: send exactly the entries where ``bf16(θ - s_k) != bf16(θ)`` (bit patterns), i.e.
   where applying the update would change what a BF16 forward pass sees. Payload = (indices, FP32
   ``s_k`` there); the new error feedback is ``s_k`` with the sent entries zeroed, so nothing is
   ever lost: ``sent + e_k == s_k`` exactly.                                  (:func:`gate`)
4. Aggregate: ``Δ = (1/n) Σ_k scatter(payload_k)`` over the n trainers that took part, FP32 on CPU,
   summed in ascending trainer-id order.                                     (:func:`aggregate`)
5. Outer Nesterov SGD on θ with momentum buffer m.                           (:func:`outer_step`)
6. Every trainer resets its local weights to the new θ.

DiLoCo (the dense baseline) is the same path with ``sparse=False``: ``s_k = θ - θ_k``, every entry
sent, no error feedback. DDP is accounted in bytes only (``pulsenet.bench.loco_phases.ddp_bytes``).

Determinism: steps 4 and 5 must give bit-identical results on every trainer, whatever its CPU.
They use numpy float32 with one IEEE-754 operation per line (add, multiply, divide, subtract are
correctly rounded, so any conforming CPU agrees), never a fused multiply-add or a reduction whose
order depends on threads or SIMD width, and a fixed summation order (trainer ids sorted).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pulsenet.codec.bf16 import visible_change
from pulsenet.codec.digest import model_digest
from pulsenet.codec.payload import DENSE, SPARSE, Payload, SparseTensor
from pulsenet.errors import PayloadError

StateDict = dict[str, torch.Tensor]
FP32_BYTES = 4


# --- one trainer: pseudo-gradient, gate, error feedback -------------------------------------


def pseudo_gradient(theta: torch.Tensor, local: torch.Tensor, error: torch.Tensor | None) -> torch.Tensor:
    """``s = e + (θ - θ_local)``: two FP32 roundings, in that order (DiLoCo: ``error=None``)."""
    s = theta - local
    if error is not None:
        s = error + s
    return s


def rebase(local: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], theta: Mapping[str, torch.Tensor]) -> StateDict:
    """``θ + (θ_local - base)``: local progress made from ``base``, moved onto the new global ``θ``
    (the one-round-delayed outer step: the next round's inner phase started before θ was known).
    FP32, the subtraction first."""
    with torch.no_grad():
        return {name: theta[name] + (local[name].detach() - base[name]) for name in theta}


def gate(theta: torch.Tensor, s: torch.Tensor, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
    """Split ``s`` into what is sent and what is kept: ``(indices, values, new_error)``.

    Sent: the entries where ``bf16(θ - scale·s) != bf16(θ)`` (``codec.bf16.visible_change``;
    ``scale`` 1 is the specified gate), as flat int64 indices and their FP32 values. Kept: ``s``
    with those entries set to +0.0. ``-0.0`` is never sent (``θ - (-0.0) == θ``), so
    ``where(sent, s, e)`` rebuilds ``s`` bit for bit.
    """
    flat = s.reshape(-1)
    mask = visible_change(theta.reshape(-1), flat if scale == 1.0 else flat * scale)
    idx = torch.nonzero(mask, as_tuple=True)[0]
    values = flat[idx].numpy().astype(np.float32, copy=True)
    residual = flat.clone()
    residual[idx] = 0.0
    return idx.numpy().astype(np.int64, copy=False), values, residual.reshape(s.shape)


def make_update(
    theta: Mapping[str, torch.Tensor],
    local: Mapping[str, torch.Tensor],
    error: Mapping[str, torch.Tensor] | None,
    *,
    round: int,
    sparse: bool,
    gate_scale: float = 1.0,
) -> tuple[Payload, StateDict | None]:
    """This round's payload and the new error feedback (``None`` for dense DiLoCo, which keeps none).

    Works tensor by tensor, so a large model never holds more than one extra copy of a tensor
    besides the returned error feedback and the sent values.
    """
    tensors: dict[str, SparseTensor] = {}
    new_error: StateDict = {}
    with torch.no_grad():
        for name in sorted(theta):
            th, lo = theta[name], local[name].detach()
            s = pseudo_gradient(th, lo, error[name] if (sparse and error is not None) else None)
            if sparse:
                idx, values, residual = gate(th, s, gate_scale)
                new_error[name] = residual
            else:
                values, idx = s.reshape(-1).numpy().astype(np.float32, copy=True), None
            tensors[name] = SparseTensor(shape=tuple(th.shape), indices=idx, values=values)
    return Payload(round=round, mode=SPARSE if sparse else DENSE, tensors=tensors), new_error if sparse else None


def unsend(error: Mapping[str, torch.Tensor], payload: Payload) -> None:
    """Put a payload's values back into the error feedback, in place: ``e = s`` again, bit for bit.

    For a trainer whose payload the round left out: its update is delayed, not lost. Exact because
    the gate zeroed exactly the sent entries (``where(sent, s, e) == s``).
    """
    for name, t in payload.tensors.items():
        if t.indices is None:
            raise PayloadError("unsend needs a sparse payload (dense DiLoCo keeps no error feedback)")
        error[name].view(-1)[torch.from_numpy(t.indices)] = torch.from_numpy(t.values)


def subtract_sent(error: Mapping[str, torch.Tensor], payload: Payload) -> None:
    """``e -= scatter(payload)`` in place: the error feedback after ``payload`` was averaged in."""
    for name, t in payload.tensors.items():
        if t.indices is None:
            raise PayloadError("subtract_sent needs a sparse payload (dense DiLoCo keeps no error feedback)")
        flat = error[name].view(-1)
        idx = torch.from_numpy(t.indices)
        flat[idx] = flat[idx] - torch.from_numpy(t.values)


def settle_error(new_error: StateDict, own: Payload, *, included: bool, stored: Payload | None) -> StateDict:
    """The error feedback after a round that averaged (``included``) or left out our update ``own``,
    in place; ``new_error`` is e after sending all of ``own`` (:func:`make_update`). ``stored``: the
    payload of ours the round averaged when it is not ``own`` (an earlier run of ours published a
    different one for the round), else None. A rejected update is not settled: the caller keeps e."""
    if not included:
        unsend(new_error, own)  # merely late: the whole update stays as error feedback
    elif stored is not None:
        # An earlier, different payload of ours was averaged: account for it, not for this one.
        unsend(new_error, own)
        subtract_sent(new_error, stored)
    return new_error


# --- validation ---------------------------------------------------------------------------------


def _sum_squares(v: np.ndarray, chunk: int = 1 << 20) -> float:
    """Σ v² in float64, a chunk at a time (a float64 copy of a whole embedding would be large)."""
    flat = v.reshape(-1)
    total = 0.0
    for i in range(0, flat.size, chunk):
        c = flat[i : i + chunk].astype(np.float64)
        total += float(np.dot(c, c))
    return total


def payload_norm(payload: Payload) -> float:
    """L2 norm of the values a payload carries (float64 accumulation; informational and for screening)."""
    return math.sqrt(sum(_sum_squares(t.values) for t in payload.tensors.values()))


def validate(payload: Payload, *, round: int, mode: int) -> float:
    """Check what decoding cannot (round, mode, finite values); return the payload's L2 norm.

    Shapes and index bounds are checked by ``payload.decode(..., expected=shapes)``.
    """
    if payload.round != round:
        raise PayloadError(f"payload is for round {payload.round}, expected {round}")
    if payload.mode != mode:
        raise PayloadError(f"payload mode {payload.mode} but this run uses mode {mode}")
    for name, t in payload.tensors.items():
        if not np.isfinite(t.values).all():
            bad = int((~np.isfinite(t.values)).sum())
            raise PayloadError(f"{name}: {bad} non-finite value(s) (NaN or inf)")
    norm = payload_norm(payload)
    if not math.isfinite(norm):
        raise PayloadError(f"payload norm overflows ({norm})")
    return norm


def weights_norm(theta: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of the global weights (float64 accumulation, sorted names): the weights' scale that
    bounds any payload. θ is agreed, so every trainer gets the same bound (up to the summation order
    of another machine's BLAS, which the readers' slack covers)."""
    return math.sqrt(sum(_sum_squares(theta[name].detach().numpy()) for name in sorted(theta)))


@dataclass(frozen=True, slots=True)
class NormScreen:
    """How large a payload may be (docs/loco.md §4, "Validation"; the factors' measured
    justification is there too).

    The record's writer excludes (:meth:`exclude`) a payload whose L2 norm is over

    - ``weights_factor x ‖θ‖``: an update the size of the weights themselves, whoever sends it;
    - ``factor x`` the round's scale: the median norm once ``min_payloads`` payloads are present
      (a minority cannot move it), else the writer's own payload norm (two trainers: each is the
      other's only reference). No reference (the writer's own payload unusable) or a zero one:
      only the absolute rule.

    A reader of the record re-checks the set it names (:meth:`refuse`) with room for a writer that
    judged against another reference: ``slack`` on the absolute and median rules (a norm summed in
    another order), and ``factor²`` against its own payload norm where the writer used its own: two
    honest trainers' norms differ by far less than ``factor`` (measured), so an honest writer's
    set never trips it, while a writer that includes a payload ``factor²`` over the reader's is
    refused rather than followed.
    """

    factor: float
    weights_factor: float
    min_payloads: int
    slack: float = 1.001

    def _scale(self, norms: Mapping[str, float], reference: float | None) -> tuple[float | None, str]:
        if len(norms) >= self.min_payloads:
            return statistics.median(norms[k] for k in sorted(norms)), "median"
        return reference, "own payload norm"

    def exclude(self, norms: Mapping[str, float], *, own: str | None, weights_norm: float) -> dict[str, str]:
        """The writer's judgement, to a fixed point: what remains passes on its own. ``own``: the
        writer's id among ``norms`` (its payload is the reference while it is not excluded itself).
        Returns payload -> reason."""
        left, out = dict(norms), {}
        while excluded := self._over(left, left.get(own) if own else None, weights_norm, self.factor, 1.0):
            out.update(excluded)
            for k in excluded:
                del left[k]
        return out

    def refuse(self, norms: Mapping[str, float], *, own: float | None, weights_norm: float) -> dict[str, str]:
        """A reader's check of a record's set: what it must not average, whoever wrote the record."""
        # factor x factor, not factor**2: a huge factor (screening off) gives inf, not an OverflowError
        relative = self.factor * self.slack if len(norms) >= self.min_payloads else self.factor * self.factor
        return self._over(norms, own, weights_norm, relative, self.slack)

    def _over(
        self, norms: Mapping[str, float], reference: float | None, weights_norm: float, factor: float, slack: float
    ) -> dict[str, str]:
        scale, what = self._scale(norms, reference)
        cap = self.weights_factor * weights_norm * slack
        out: dict[str, str] = {}
        for k in sorted(norms):
            if norms[k] > cap:
                out[k] = f"outsized: norm {norms[k]:.4g} > {self.weights_factor:g} x weights norm {weights_norm:.4g}"
            elif scale is not None and scale > 0.0 and norms[k] > factor * scale:
                out[k] = f"outsized: norm {norms[k]:.4g} > {factor:g} x {what} {scale:.4g}"
        return out


# --- all trainers: aggregate and outer step ---------------------------------------------------


def aggregate(
    payloads: Mapping[str, Payload], shapes: Mapping[str, tuple[int, ...]]
) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, Δ)`` per tensor: the FP32 mean of the payloads, summed in ascending trainer-id order.

    Entries a trainer did not send count as zero; the mean divides by the number of payloads.
    Indices are unique within a payload, so ``acc[idx] += values`` is one rounding per entry.
    Yields tensor by tensor (sorted names) so the caller can apply each and drop it.
    """
    if not payloads:
        raise PayloadError("cannot aggregate zero payloads")
    order = sorted(payloads)
    n = np.float32(len(order))
    for name in sorted(shapes):
        numel = int(np.prod(shapes[name], dtype=np.int64))
        acc = np.zeros(numel, dtype=np.float32)
        for tid in order:
            t = payloads[tid].tensors[name]
            if t.indices is None:  # dense
                np.add(acc, t.values, out=acc)
            else:
                acc[t.indices] += t.values
        np.divide(acc, n, out=acc)
        yield name, acc.reshape(shapes[name])


def outer_step(
    theta: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    deltas: Iterable[tuple[str, np.ndarray]],
    *,
    lr: float,
    mu: float,
) -> None:
    """Nesterov SGD on θ in place, PyTorch's convention (``torch.optim.SGD(nesterov=True, dampening=0)``,
    after Sutskever et al. 2013, as DiLoCo uses it)::

        m = μ·m + Δ
        θ = θ - lr·(Δ + μ·m)

    ``lr=1, mu=0`` is plain averaging (θ = θ - Δ = mean of the local weights, for dense Δ).
    """
    for name, delta in deltas:
        _nesterov(theta[name].numpy(), momentum[name].numpy(), delta, lr, mu, commit=True)  # views


def outer_step_finite(
    theta: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    deltas: Iterable[tuple[str, np.ndarray]],
    *,
    lr: float,
    mu: float,
) -> str | None:
    """Whether :func:`outer_step` would leave every Δ, m and θ entry finite, computed without
    changing anything: None if so, else the first tensor where it would not."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is what this looks for
        for name, delta in deltas:
            if not np.isfinite(delta).all():
                return f"{name}: the mean update is non-finite"
            m, th = _nesterov(theta[name].numpy(), momentum[name].numpy(), delta, lr, mu, commit=False)
            if not (np.isfinite(m).all() and np.isfinite(th).all()):
                return f"{name}: the outer step makes the weights or the momentum non-finite"
    return None


def _nesterov(
    th: np.ndarray, m: np.ndarray, delta: np.ndarray, lr: float, mu: float, *, commit: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One tensor's outer step: ``(m', θ')``, in place when ``commit``, else in new arrays. Each line
    is one correctly rounded float32 operation per element, the same bits either way."""
    lr32, mu32 = np.float32(lr), np.float32(mu)
    m2 = np.multiply(m, mu32, out=m if commit else None)  # m = μ·m
    np.add(m2, delta, out=m2)  # m = μ·m + Δ
    u = np.multiply(m2, mu32)  # μ·m
    np.add(delta, u, out=u)  # Δ + μ·m
    np.multiply(u, lr32, out=u)  # lr·(Δ + μ·m)
    th2 = np.subtract(th, u, out=th if commit else u)  # θ - lr·(Δ + μ·m)
    return m2, th2


def apply_round(
    theta: Mapping[str, torch.Tensor],
    momentum: Mapping[str, torch.Tensor],
    payloads: Mapping[str, Payload],
    *,
    lr: float,
    mu: float,
) -> str | None:
    """Aggregate ``payloads`` and take the outer step, in place. The same call on every trainer.

    Never applies non-finite weights: a first pass computes the step without committing it, and if
    any entry of Δ, m or θ would be non-finite, nothing changes and the reason is returned (the
    round is void: docs/loco.md §4). Otherwise the second pass recomputes the same bits in place
    and None is returned. Deterministic, so every trainer (and every replay) decides alike.
    """
    shapes = {name: tuple(t.shape) for name, t in theta.items()}
    why = outer_step_finite(theta, momentum, aggregate(payloads, shapes), lr=lr, mu=mu)
    if why is None:
        outer_step(theta, momentum, aggregate(payloads, shapes), lr=lr, mu=mu)
    return why


def global_digest(theta: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 model digest (``codec.digest``) of the global weights and the outer momentum together."""
    tensors = {f"theta/{n}": t for n, t in theta.items()}
    tensors.update({f"momentum/{n}": t for n, t in momentum.items()})
    return model_digest(tensors)


def sent_fraction(payloads: Sequence[Payload]) -> float:
    sent = sum(p.sent for p in payloads)
    total = sum(p.total for p in payloads)
    return sent / total if total else 0.0
