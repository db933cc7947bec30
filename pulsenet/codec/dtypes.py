"""Dtype names as safetensors spells them, so the format speaks the checkpoint's language."""

from __future__ import annotations

import torch

from pulsenet.errors import PatchError

_BY_NAME: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_BY_DTYPE = {v: k for k, v in _BY_NAME.items()}

# IEEE-style sign-magnitude floats: their bits map to an integer order that follows the value order.
SIGN_MAGNITUDE = frozenset({"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"})


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _BY_DTYPE[dtype]
    except KeyError:
        raise PatchError(f"unsupported dtype {dtype}; supported: {sorted(_BY_NAME)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise PatchError(f"unknown dtype {name!r} in patch; supported: {sorted(_BY_NAME)}") from None
