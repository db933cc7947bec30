"""The PULSE paper's patch encoding, kept as the baseline every benchmark compares against.

Per tensor: changed flat indices, sorted, delta-coded (first absolute), downcast to the narrowest
unsigned type that holds the largest delta; the new values' raw bits; everything concatenated and
compressed as one zstd frame. Size only: nothing decodes this.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from pulsenet.codec.bf16 import bits
from pulsenet.codec.coding import UINT, compress, narrowest_width


def paper_patch_size(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], level: int = 3) -> int:
    parts: list[bytes] = []
    for name in sorted(new):
        b = bits(new[name])
        if name not in old or old[name].shape != new[name].shape or old[name].dtype != new[name].dtype:
            parts.append(b.tobytes())
            continue
        idx = np.flatnonzero(bits(old[name]) != b)
        if idx.size == 0:
            continue
        d = np.diff(idx, prepend=0)
        parts.append(d.astype(UINT[narrowest_width(int(d.max()))]).tobytes())
        parts.append(b[idx].tobytes())
    return len(compress(b"".join(parts), level))
