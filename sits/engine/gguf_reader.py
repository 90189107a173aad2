"""A GGUF file's metadata and tensor index, decoded with ``struct`` from one read-only memory map.

The ``gguf`` package's reader makes a numpy view of every value in the file, each string of a
tokenizer's vocabulary and merges among them, which costs seconds per process for a 49k-token
vocabulary (docs/benchmarks.md); here the metadata is decoded straight from the bytes. Tensors stay
views of the map, shaped as the package's reader shapes them, so its dequantization reads them.
Little-endian GGUF versions 2 and 3 (what llama.cpp writes).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]           # GGUF's order: the fastest-varying dimension first
    data: np.ndarray                 # a read-only view of the file (rows of bytes for a quantized type)


class GGUFFile:
    """``metadata``: every key's value (str, int, float, bool, or a list of them); ``tensors``: in file order."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if len(buf) < 24 or buf[:4] != MAGIC:
            raise ValueError("no GGUF magic at the start of the file")
        version = _U32.unpack_from(buf, 4)[0]
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as "
                             "a huge version)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        off = 24
        self.metadata: dict[str, Any] = {}
        index: dict[str, tuple] = {}
        try:
            for _ in range(n_kv):
                key, off = _string(buf, off)
                value_type = _U32.unpack_from(buf, off)[0]
                if key in self.metadata:
                    raise ValueError(f"metadata key {key} appears twice")
                self.metadata[key], off = _value(buf, off + 4, value_type)
            for _ in range(n_tensors):
                name, off = _string(buf, off)
                n_dims = _U32.unpack_from(buf, off)[0]
                if n_dims > 4:
                    raise ValueError(f"tensor {name} has {n_dims} dimensions (GGML has at most 4)")
                dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
                raw_type, rel = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
                off += 4 + 8 * n_dims + 12
                if name in index:
                    raise ValueError(f"tensor {name} appears twice")
                index[name] = (dims, GGMLQuantizationType(raw_type), rel)
        except (struct.error, OverflowError) as e:
            raise ValueError(f"truncated or corrupt GGUF header: {e}") from None
        align = self.metadata.get("general.alignment", 32)
        if type(align) is not int or align <= 0 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of two")
        start = off + (-off % align)
        data = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: list[GGUFTensor] = []
        for name, (dims, kind, rel) in index.items():
            if rel % align:
                raise ValueError(f"tensor {name} is not aligned to {align} bytes")
            n = math.prod(dims)
            shape = tuple(reversed(dims))
            if kind not in GGML_QUANT_SIZES:
                raise ValueError(f"tensor {name} has type {kind.name}, whose layout is unknown")
            block, type_size = GGML_QUANT_SIZES[kind]
            nbytes = n * type_size // block
            if start + rel + nbytes > len(buf):
                raise ValueError(f"tensor {name} runs past the end of the file")
            raw = data[start + rel:start + rel + nbytes]
            if kind in _PLAIN:
                view = raw.view(_PLAIN[kind]).reshape(shape)
            else:
                view = raw.reshape(quant_shape_to_byte_shape(shape, kind))
            self.tensors.append(GGUFTensor(name, kind, tuple(dims), view))


def _string(buf, off: int) -> tuple[str, int]:
    n = _U64.unpack_from(buf, off)[0]
    if off + 8 + n > len(buf):
        raise struct.error("a string runs past the end of the file")
    # strict: two undecodable tokens must not become the same string (UnicodeDecodeError is a ValueError)
    return buf[off + 8:off + 8 + n].decode("utf-8"), off + 8 + n


def _value(buf, off: int, value_type: int) -> tuple[Any, int]:
    if value_type == _STRING:
        return _string(buf, off)
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack_from(fmt, buf, off)[0], off + struct.calcsize(fmt)
    if value_type == _ARRAY:
        item_type, n = struct.unpack_from("<IQ", buf, off)
        off += 12
        if n > len(buf) - off:                       # every item takes a byte at least
            raise struct.error(f"an array of {n} items runs past the end of the file")
        if item_type in _SCALARS:                    # numbers: one numpy read
            dtype = np.dtype(_SCALARS[item_type])
            if n * dtype.itemsize > len(buf) - off:
                raise struct.error(f"an array of {n} items runs past the end of the file")
            values = np.frombuffer(buf, dtype=dtype, count=n, offset=off)
            return values.tolist(), off + n * dtype.itemsize
        out = []
        for _ in range(n):
            v, off = _value(buf, off, item_type)
            out.append(v)
        return out, off
    raise ValueError(f"unknown GGUF value type {value_type}")
