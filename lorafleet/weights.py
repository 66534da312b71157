"""Read safetensors files without loading them: the header, the layout rules the engine's
loader enforces, and a streamed scan of the weights for values that are not finite.

Layout (as the ``safetensors`` library checks it when vLLM opens the file): 8 bytes of
little-endian header length, a JSON header, then the data region, which the tensors tile
exactly: sorted by offset, each begins where the previous ends, each spans its shape times
its dtype's size, and the last ends at the end of the file.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from contracts import strict_json

MAX_HEADER_BYTES = 100 * 1024 * 1024
SCAN_CHUNK_BYTES = 1024 * 1024
"""Bytes of weights held at once by the scan (a multiple of every item size)."""

DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
# A float is NaN or infinite exactly when its exponent bits are all ones: compare the raw
# bits (bf16 has no numpy dtype, and no value is converted).
_EXPONENT_BITS = {
    "F32": ("<u4", 0x7F80_0000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
}
SCANNED_DTYPES = frozenset(_EXPONENT_BITS)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: dtype, shape and its byte span ``[start, end)`` in the data region."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorInfo]
    data_start: int
    """File offset of the data region."""
    data_bytes: int


def read_header(path: Path) -> Header:
    """Tensor names, dtypes, shapes and spans (weights are not read). Raises ``ValueError``
    if the header is malformed or a span points outside the file."""
    size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError("file is shorter than a safetensors header")
        (length,) = struct.unpack("<Q", prefix)
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header length {length} does not fit the file")
        header = strict_json.loads(handle.read(length))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise ValueError("__metadata__ must map names to strings")
    data_bytes = size - 8 - length
    tensors = {name: _tensor(name, info, data_bytes) for name, info in header.items()}
    return Header(tensors=tensors, data_start=8 + length, data_bytes=data_bytes)


def _tensor(name: str, info: object, data_bytes: int) -> TensorInfo:
    if not isinstance(info, dict):
        raise ValueError(f"tensor {name}: entry is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise ValueError(f"tensor {name}: dtype is not a string")
    if not isinstance(shape, list) or not all(_natural(n) for n in shape):
        raise ValueError(f"tensor {name}: shape is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_natural, offsets)):
        raise ValueError(f"tensor {name}: data_offsets is not two non-negative integers")
    start, end = offsets
    if not start <= end <= data_bytes:
        raise ValueError(f"tensor {name} points outside the file")
    return TensorInfo(dtype=dtype, shape=tuple(shape), start=start, end=end)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_layout(header: Header) -> None:
    """Refuse (``ValueError``) a file the engine's loader would refuse: spans that do not
    match their shape and dtype, overlap, leave gaps, or do not end at the end of the file."""
    position = 0
    for name, info in sorted(header.tensors.items(), key=lambda item: item[1].start):
        item_bytes = DTYPE_BYTES.get(info.dtype)
        if item_bytes is None:
            raise ValueError(f"tensor {name}: unknown dtype {info.dtype}")
        expected = math.prod(info.shape) * item_bytes
        if info.end - info.start != expected:
            raise ValueError(
                f"tensor {name}: data_offsets span {info.end - info.start} bytes; shape "
                f"{list(info.shape)} of {info.dtype} needs {expected}"
            )
        if info.start != position:
            what = "overlaps the tensor before it" if info.start < position else "leaves a gap"
            raise ValueError(f"tensor {name} {what} (starts at {info.start}, not {position})")
        position = info.end
    if position != header.data_bytes:
        raise ValueError(
            f"the tensors cover {position} bytes of a {header.data_bytes}-byte data region"
        )


def first_non_finite(path: Path, header: Header) -> str | None:
    """The first tensor (in file order) holding a NaN or an infinity, else ``None``. Reads
    ``SCAN_CHUNK_BYTES`` at a time; expects ``check_layout`` to have passed and every dtype to
    be in ``SCANNED_DTYPES``."""
    with path.open("rb") as handle:
        for name, info in sorted(header.tensors.items(), key=lambda item: item[1].start):
            dtype, exponent = _EXPONENT_BITS[info.dtype]
            handle.seek(header.data_start + info.start)
            remaining = info.end - info.start
            while remaining:
                chunk = handle.read(min(SCAN_CHUNK_BYTES, remaining))
                if not chunk:
                    raise ValueError(f"tensor {name}: the file ends inside it")
                remaining -= len(chunk)
                bits = np.frombuffer(chunk, dtype=dtype)
                if np.any((bits & exponent) == exponent):
                    return name
    return None
