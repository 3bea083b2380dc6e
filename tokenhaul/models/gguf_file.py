"""A GGUF file read with struct over a memory map: metadata (long arrays such as the vocabulary are
stepped over, never decoded) and every tensor as a numpy view of its bytes, typed as gguf's own reader
types it. gguf's GGUFReader decodes each of Qwen2.5's 151k tokens and merges into Python objects: 27 s
per open here, where this takes milliseconds."""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from tokenhaul.errors import ModelError

MAX_ARRAY = 1024  # arrays longer than this are skipped (tokenizer vocabularies, scores, merges)
_SKIPPED = object()  # what a skipped array reads as
_T = GGUFValueType
_SCALARS = {_T.UINT8: "B", _T.INT8: "b", _T.UINT16: "H", _T.INT16: "h", _T.UINT32: "I", _T.INT32: "i",
            _T.FLOAT32: "f", _T.BOOL: "?", _T.UINT64: "Q", _T.INT64: "q", _T.FLOAT64: "d"}
_Q = GGMLQuantizationType
_ELEMENT_DTYPES = {_Q.F32: np.float32, _Q.F16: np.float16, _Q.F64: np.float64, _Q.I8: np.int8,
                   _Q.I16: np.int16, _Q.I32: np.int32, _Q.I64: np.int64}  # other types: raw uint8 blocks


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor: `shape` in GGUF order (innermost first); `data` a read-only view into the file, shaped
    outermost first, its last axis the bytes of a row for block-quantized types (as GGUFReader's)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))


class GGUFFile:
    """`metadata`: key → scalar, string or short list; `tensors`: in file order (only with `tensors=True`)."""

    def __init__(self, path: Path, tensors: bool = True) -> None:
        self.path = Path(path)
        try:
            with self.path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self.metadata, infos, end = self._parse_header()
        except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
            raise ModelError(f"{self.path} is not a readable GGUF file: {e}") from None
        self.tensors = self._tensors(infos, end) if tensors else []

    def _parse_header(self) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
        m = self._map
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", m, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError("not a little-endian GGUF v2/v3 file")
        self._offs = 24
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            value = self._value(self._unpack("I"))
            if value is not _SKIPPED:
                meta[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = tuple(self._unpack("Q") for _ in range(self._unpack("I")))
            infos.append((name, dims, self._unpack("I"), self._unpack("Q")))
        return meta, infos, self._offs

    def _unpack(self, fmt: str) -> Any:
        (v,) = struct.unpack_from("<" + fmt, self._map, self._offs)
        self._offs += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("Q")
        s = self._map[self._offs : self._offs + n].decode("utf-8", errors="replace")
        self._offs += n
        return s

    def _value(self, kind: int) -> Any:
        kind = GGUFValueType(kind)
        if kind == _T.STRING:
            return self._string()
        if kind != _T.ARRAY:
            return self._unpack(_SCALARS[kind])
        elem, count = GGUFValueType(self._unpack("I")), self._unpack("Q")
        if count <= MAX_ARRAY:
            return [self._value(elem) for _ in range(count)]
        if elem == _T.STRING:
            for _ in range(count):
                self._offs += 8 + struct.unpack_from("<Q", self._map, self._offs)[0]
        elif elem == _T.ARRAY:
            raise ValueError("a long array of arrays")
        else:
            self._offs += count * struct.calcsize(_SCALARS[elem])
        return _SKIPPED

    def _tensors(self, infos: list[tuple[str, tuple[int, ...], int, int]], end: int) -> list[GGUFTensor]:
        align = int(self.metadata.get("general.alignment", 32))
        start = end + (-end % align)
        out = []
        for name, dims, raw_type, offset in infos:
            qtype = GGMLQuantizationType(raw_type)
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims))
            outer = tuple(reversed(dims))
            dtype = _ELEMENT_DTYPES.get(qtype)
            if dtype is None:
                count, dtype, outer = n * size // block, np.uint8, (*outer[:-1], outer[-1] * size // block)
            else:
                count = n
            data = np.frombuffer(self._map, dtype=dtype, count=count, offset=start + offset).reshape(outer)
            out.append(GGUFTensor(name, qtype, dims, data))
        return out

