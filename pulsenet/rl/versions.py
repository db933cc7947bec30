"""The BF16 weights of the last few published versions, at the cost of one full state.

Replay (rl/replay.py) must rebuild any version still inside the staleness bound (``max_staleness
+ 1`` of them). Full copies cost 2 bytes per parameter each; at RL learning rates ~99% of BF16
values do not change from one version to the next, so only the newest version is held whole (the
published state itself, by reference: published states are never written to) and each older one
as an undo patch against its successor: the flat positions whose bits differ and the older
version's values there. Version v is the newest with the undo patches from the newest down to v
applied; ``load_into`` writes it straight into a model's parameters (BF16 widens to FP32 exactly),
so no second full state is ever built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class Undo:
    """What turns one tensor of a version's successor back into the version's own."""

    positions: torch.Tensor | None
    """Flat positions whose bits differ (int32 where the tensor allows, else int64), ascending;
    None: ``values`` is the older tensor whole (most of it changed: positions would cost more)."""
    values: torch.Tensor
    """The older version's values there (its dtype)."""

    @property
    def nbytes(self) -> int:
        pos = 0 if self.positions is None else self.positions.numel() * self.positions.element_size()
        return pos + self.values.numel() * self.values.element_size()

    def apply(self, flat: torch.Tensor) -> None:
        """Write the older values into ``flat`` (a flat tensor of the successor's values, any dtype
        they widen to exactly)."""
        if self.positions is None:
            flat.copy_(self.values.reshape(-1))
        else:
            flat[self.positions.long()] = self.values.to(flat.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(_INTS[t.element_size()])


def undo(old: torch.Tensor, new: torch.Tensor) -> Undo | None:
    """The positions where ``old``'s bits differ from ``new``'s and ``old``'s values there, or
    ``old`` itself (by reference) when that costs less; None if none differ (or ``old`` is ``new``).
    Shapes and dtypes must agree."""
    if old is new:
        return None
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"undo: {old.dtype} {tuple(old.shape)} vs {new.dtype} {tuple(new.shape)}")
    where = (_bits(old) != _bits(new)).nonzero()[:, 0]
    if not where.numel():
        return None
    positions = where.to(torch.int32) if old.numel() < 2**31 else where
    if where.numel() * (positions.element_size() + old.element_size()) >= old.numel() * old.element_size():
        return Undo(None, old)
    return Undo(positions, old.detach().reshape(-1)[where].clone())


class VersionStore:
    """The last ``keep`` versions remembered: the newest whole, the others as undo patches."""

    def __init__(self, keep: int) -> None:
        self.keep = max(1, keep)
        self._newest: tuple[int, Mapping[str, torch.Tensor]] | None = None
        self._undo: dict[int, dict[str, Undo]] = {}
        """Older version -> per tensor, what turns its successor (the next newer one held) back into it."""
        self._order: list[int] = []
        """Versions held, oldest first."""

    def remember(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """``version``'s BF16 state (kept by reference: never write to it). The previous newest
        becomes an undo patch; the oldest beyond ``keep`` is forgotten. A version not newer than
        the newest (a trainer restarted on an older chain) starts the store afresh."""
        if self._newest is not None and version <= self._newest[0]:
            self._newest, self._undo, self._order = None, {}, []
        if self._newest is not None:
            old_v, old = self._newest
            patch = {}
            for name, t in old.items():
                u = undo(t, state[name])
                if u is not None:
                    patch[name] = u
            self._undo[old_v] = patch
        self._newest = (version, state)
        self._order.append(version)
        while len(self._order) > self.keep:
            self._undo.pop(self._order.pop(0), None)

    def __contains__(self, version: object) -> bool:
        return version in self._order

    @property
    def versions(self) -> list[int]:
        """The versions held, oldest first."""
        return list(self._order)

    def _path(self, version: int) -> tuple[Mapping[str, torch.Tensor], list[dict[str, Undo]]]:
        """The newest state and the undo patches that take it back to ``version``, newest first."""
        if self._newest is None or version not in self._order:
            raise KeyError(f"v{version} is not held (held: {self._order})")
        return self._newest[1], [self._undo[v] for v in reversed(self._order[self._order.index(version) : -1])]

    def load_into(self, version: int, params: Mapping[str, torch.Tensor]) -> None:
        """Write ``version``'s values into ``params`` (same names and shapes, contiguous, of a dtype
        the values widen to exactly, e.g. a model's FP32 parameters); no full state is built."""
        newest, path = self._path(version)
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(newest[name])
                flat = p.view(-1)
                for patch in path:
                    u = patch.get(name)
                    if u is not None:
                        u.apply(flat)

    def state(self, version: int) -> dict[str, torch.Tensor]:
        """``version``'s whole state (a new dict; the newest's own tensors where no patch touches them)."""
        newest, path = self._path(version)
        out, copied = dict(newest), set()
        for patch in path:
            for name, u in patch.items():
                if name not in copied:
                    out[name] = out[name].clone()
                    copied.add(name)
                u.apply(out[name].view(-1))
        return out

    def patches(self) -> list[Undo]:
        """Every undo patch held (what the older versions cost)."""
        return [u for p in self._undo.values() for u in p.values()]

    def nbytes(self) -> dict[str, int]:
        """Bytes held: ``newest`` (the whole state, shared with the publisher) and ``patches``."""
        newest = 0 if self._newest is None else sum(t.numel() * t.element_size() for t in self._newest[1].values())
        return {"newest": newest, "patches": sum(u.nbytes for p in self._undo.values() for u in p.values())}
