"""safetensors files, read one tensor at a time after checking the header, and written one shard at a time.

The format: an 8-byte little-endian header length N, N bytes of JSON `{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the data (offsets relative to its start).
Nothing in it can run code, but a hostile or broken file can still claim a header of gigabytes, byte ranges
past the end of the file, or a shape its bytes do not hold: `SafetensorsFile` refuses each of these with one
line naming the file and the tensor before any tensor is read, and reads a tensor with plain `readinto`
(no mmap, so the process holds only the tensors it asked for). `write_file` writes a dict of tensors
without staging the file's bytes in memory (the safetensors package's `save_file` copies every tensor
into one bytes object first); `write_files` the small files beside them (tokenizer, templates).
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch

from kubetron.contract.errors import ConfigError

# safetensors' own limit on the header (its Rust reader refuses more): no model's header comes near it.
MAX_HEADER_BYTES = 100_000_000
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}  # what model weights are
_NAMES = {v: k for k, v in DTYPES.items()}
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
              "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
ALIGN = 8  # the header is padded with spaces so the data starts 8-byte aligned (as safetensors writes it)


class Entry:
    """One tensor's header entry, checked against the file: `dtype` a name of DTYPES, bytes inside the data."""

    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _bad(path: str, what: str) -> ConfigError:
    return ConfigError("HF weights", f"{path}: {what}")


def _entry(path: str, name: str, raw, data_bytes: int) -> Entry:
    """A header entry, every field checked: a known dtype, a shape of whole numbers whose bytes are exactly
    the entry's byte range, which lies inside the file."""
    if not isinstance(raw, dict):
        raise _bad(path, f"tensor {name}: header entry is not an object")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if dtype not in ITEM_BYTES:
        raise _bad(path, f"tensor {name}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and d >= 0 for d in shape):
        raise _bad(path, f"tensor {name}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise _bad(path, f"tensor {name}: data_offsets {offsets!r} is not [begin, end]")
    if offsets[1] > data_bytes:
        raise _bad(path, f"tensor {name}: bytes {offsets[0]}..{offsets[1]} lie past the end of the file "
                         f"({data_bytes} bytes of data)")
    if math.prod(shape) * ITEM_BYTES[dtype] != offsets[1] - offsets[0]:
        raise _bad(path, f"tensor {name}: {offsets[1] - offsets[0]} bytes do not hold a {dtype} tensor of "
                         f"shape {shape}")
    return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


class SafetensorsFile:
    """The header of one safetensors file, checked; `read(name)` one tensor. Closed by `close()`."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "rb")  # noqa: SIM115 - held until close(): tensors are read on demand
        try:
            self.entries, self.data_start = self._header(os.fstat(self._f.fileno()).st_size)
        except BaseException:
            self._f.close()
            raise

    def _header(self, size: int) -> tuple[dict[str, Entry], int]:
        head = self._f.read(8)
        if len(head) < 8:
            raise _bad(self.path, "not a safetensors file (shorter than its 8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise _bad(self.path, f"not a safetensors file (claims a header of {n} bytes in a file of {size})")
        try:
            header = json.loads(self._f.read(n))
        except (UnicodeDecodeError, ValueError) as e:
            raise _bad(self.path, f"not a safetensors file (header is not JSON: {e})") from None
        if not isinstance(header, dict):
            raise _bad(self.path, "not a safetensors file (header is not a JSON object)")
        header.pop("__metadata__", None)
        data_bytes = size - 8 - n
        return {k: _entry(self.path, k, v, data_bytes) for k, v in header.items()}, 8 + n

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` (a floating-point dtype of DTYPES; the caller checked its name and shape)."""
        e = self.entries[name]
        if e.dtype not in DTYPES:
            raise _bad(self.path, f"tensor {name}: dtype {e.dtype} is not a floating-point weight "
                                  f"({', '.join(DTYPES)})")
        buf = bytearray(e.nbytes)
        self._f.seek(self.data_start + e.begin)
        if self._f.readinto(buf) != e.nbytes:
            raise _bad(self.path, f"tensor {name}: file ended while reading it")
        if not buf:
            return torch.empty(e.shape, dtype=DTYPES[e.dtype])
        return torch.frombuffer(buf, dtype=DTYPES[e.dtype]).reshape(e.shape)

    def close(self) -> None:
        self._f.close()


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise ConfigError("CKPT", f"tensors of dtype {dtype} have no safetensors weight form here")
    return _NAMES[dtype]


def write_file(path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` (in this order) as a safetensors file at `path`, streaming each tensor's bytes; returns
    the file's size. Written to `path`.tmp and renamed, so `path` is whole or absent."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors.values():
            raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
            f.write(memoryview(raw))  # type: ignore[arg-type]  # (numpy's stubs: an ndarray is no Buffer)
    os.replace(path + ".tmp", path)
    return 8 + len(text) + offset


def write_files(out: str, files: dict[str, bytes]) -> None:
    """`files` {relative name: bytes} under `out` (names from a store listing: no '..', no absolute path)."""
    for rel, data in files.items():
        parts = rel.split("/")
        if ".." in parts or "" in parts:
            raise ConfigError("CKPT", f"tokenizer file {rel!r}: not a plain relative name")
        path = os.path.join(out, *parts)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
