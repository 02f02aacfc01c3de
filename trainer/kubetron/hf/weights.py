"""Canonical tensors read one at a time: from an HF directory's safetensors files, a kubetron checkpoint, or a
LoRA checkpoint's base with its adapters merged in.

Each source is a read-only mapping {canonical name: tensor} whose `spec(name)` tells a tensor's shape and
dtype without reading it, and whose `[name]` reads (and converts, or merges) that tensor only. import-hf,
export-hf and a fine-tune from an HF directory walk a source tensor by tensor, so no copy of the whole model
is ever held next to another (export-hf: one output shard at a time).

An HF directory's weights are the files transformers reads: `model.safetensors`, else the shards
`model.safetensors.index.json` lists, else `model*.safetensors` (a Mistral repository's
`consolidated.safetensors` beside them is not the HF model). Every file's header is checked before a tensor is
read: each entry must be one the model's config.json gives (name, shape) in a floating-point dtype; a
`pytorch_model.bin` (a pickle, which can run code) is never opened.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Mapping

import torch

from kubetron.compat import megatron_core
from kubetron.contract.errors import ConfigError
from kubetron.hf import convert
from kubetron.hf.safetensors_io import DTYPES, SafetensorsFile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_INDEX_BYTES = 64 << 20  # a 70B model's index is ~60 KB


class Source(Mapping):
    """{canonical name: tensor}, each read on access; `spec(name)`: (shape, dtype) without reading. Its keys are
    `names`, in order."""

    names: list[str]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def spec(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        raise NotImplementedError

    def nbytes(self, name: str) -> int:
        shape, dtype = self.spec(name)
        n = dtype.itemsize
        for d in shape:
            n *= d
        return n

    def close(self) -> None:  # noqa: B027 - an optional hook
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InMemory(Source):
    """Tensors already in memory (a `model.pt`)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors, self.names = tensors, list(tensors)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


    def spec(self, name: str):
        t = self.tensors[name]
        return tuple(t.shape), t.dtype


# --- an HF directory ------------------------------------------------------------------------------

def _bin_note(hf_dir: str, names: list[str]) -> str:
    others = sorted(n for n in names if n.endswith(".safetensors"))
    if any(n.endswith(".bin") for n in names):
        return (" (pytorch_model*.bin files are pickles, which can run code, and are never loaded: save the "
                "model with safetensors, e.g. transformers' save_pretrained)")
    return f" (not read: {', '.join(others[:3])})" if others else ""


def _read_index(hf_dir: str) -> dict[str, str]:
    """model.safetensors.index.json's weight_map {tensor: file}, every file a plain name in `hf_dir`."""
    path = os.path.join(hf_dir, INDEX)
    if os.path.getsize(path) > MAX_INDEX_BYTES:
        raise ConfigError("HF_DIR", f"{path}: larger than {MAX_INDEX_BYTES} bytes, not a weight index")
    try:
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError("HF_DIR", f"{path}: not a safetensors index ({e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError("HF_DIR", f"{path}: has no weight_map of tensor names to files")
    for file in set(weight_map.values()):
        if os.path.basename(file) != file or file in ("", ".", "..") or not file.endswith(".safetensors"):
            raise ConfigError("HF_DIR", f"{path}: names {file!r}, not a .safetensors file of {hf_dir}")
        if not os.path.isfile(os.path.join(hf_dir, file)):
            raise ConfigError("HF_DIR", f"{path}: names {file}, which is not in {hf_dir}")
    return weight_map


def weight_files(hf_dir: str) -> tuple[list[str], dict[str, str] | None]:
    """(the safetensors files transformers would read, the index's weight_map or None)."""
    if os.path.isfile(os.path.join(hf_dir, SINGLE)):
        return [os.path.join(hf_dir, SINGLE)], None
    if os.path.isfile(os.path.join(hf_dir, INDEX)):
        weight_map = _read_index(hf_dir)
        return [os.path.join(hf_dir, f) for f in sorted(set(weight_map.values()))], weight_map
    files = sorted(glob.glob(os.path.join(glob.escape(hf_dir), "model*.safetensors")))
    if not files:
        raise ConfigError("HF_DIR", f"{hf_dir}: no {SINGLE}, {INDEX} or model-*.safetensors"
                                    + _bin_note(hf_dir, os.listdir(hf_dir)))
    return files, None


class HFWeights(Source):
    """The canonical tensors of an HF directory for model keys `m`, every header checked on opening."""

    def __init__(self, hf_dir: str, m: dict):
        self.m, self.units = m, {u.canonical: u for u in convert.units(m)}
        self.names = list(self.units)
        files, weight_map = weight_files(hf_dir)
        self.files: list[SafetensorsFile] = []
        self.where: dict[str, SafetensorsFile] = {}
        try:
            for path in files:
                self.files.append(SafetensorsFile(path))
                self._check(self.files[-1], convert.hf_shapes(m), weight_map)
            self._check_complete(files)
        except BaseException:
            self.close()
            raise

    def _check(self, f: SafetensorsFile, expected: dict, weight_map: dict[str, str] | None) -> None:
        """Every entry of `f` is a tensor the model has (name, shape, a floating-point dtype), in no other file."""
        for name, e in f.entries.items():
            if convert.is_tolerated_extra(name, self.m):
                continue
            shape = expected.get(name)
            if shape is None:
                raise ConfigError("HF weights", f"{f.path}: tensor {name} is not one this model has "
                                                "(config.json describes another architecture or size)")
            if e.shape != shape:
                raise ConfigError("HF weights", f"{f.path}: tensor {name} has shape {list(e.shape)}, config.json "
                                                f"gives {list(shape)}")
            if e.dtype not in DTYPES:
                raise ConfigError("HF weights", f"{f.path}: tensor {name} is {e.dtype}, not a floating-point "
                                                f"weight ({', '.join(DTYPES)})")
            if name in self.where:
                raise ConfigError("HF weights", f"{f.path}: tensor {name} is also in {self.where[name].path}")
            if weight_map is not None and weight_map.get(name) != os.path.basename(f.path):
                raise ConfigError("HF weights", f"{f.path}: tensor {name} is listed in {INDEX} under "
                                                f"{weight_map.get(name)!r}")
            self.where[name] = f

    def _check_complete(self, files: list[str]) -> None:
        for u in self.units.values():
            missing = [p for p in u.hf if p not in self.where]
            if missing:
                names = ", ".join(os.path.basename(f) for f in files)
                raise ConfigError("HF weights", f"tensor {missing[0]} is missing from {names}")

    def __getitem__(self, name: str) -> torch.Tensor:
        u = self.units[name]
        return convert.to_canonical(u, [self.where[p].read(p) for p in u.hf], self.m)


    def spec(self, name: str):
        u = self.units[name]
        parts = [self.where[p].entries[p] for p in u.hf]
        first = parts[0].shape
        shape = first if u.kind == "same" else (sum(e.shape[0] for e in parts), *first[1:])
        return shape, DTYPES[parts[0].dtype]

    def close(self) -> None:
        for f in self.files:
            f.close()


# --- a kubetron checkpoint --------------------------------------------------------------------------

class Sharded(Source):
    """The model tensors of a `sharded` checkpoint (format_sharded), each read whole on access. A gated fc1 is
    kept there as (2, ffn, ...) = [gate, up]; here it is canonical [gate; up]."""

    def __init__(self, store, name: str, num_shards: int):
        megatron_core.install()  # megatron-core imported the trainer's way (without its TE/Apex notices)
        from kubetron.checkpoint.format_sharded import ShardReader, shard_key

        self.store, self.dir, self.shard_key = store, name, shard_key
        self.reader = ShardReader(store, name, num_shards)
        self.names = sorted(n[len("model/"):] for n in self.reader.pieces if n.startswith("model/"))

    def __getitem__(self, name: str) -> torch.Tensor:
        gshape = self.reader.global_shape(f"model/{name}")
        pieces = self.reader.pieces[f"model/{name}"]
        if len(pieces) == 1 and [tuple(b) for b in pieces[0]["box"]] == [(0, g) for g in gshape]:
            return self._whole(pieces[0]).reshape(self.spec(name)[0])  # saved in one piece: read into place
        t = self.reader.read_many([(f"model/{name}", [(0, g) for g in gshape])])[0]
        return t.reshape(self.spec(name)[0])

    def _whole(self, e: dict) -> torch.Tensor:
        """A piece that is the whole tensor, read into its own buffer: on a filesystem straight from the file (one
        copy of its bytes), from S3 by one ranged GET."""
        key = f"{self.dir}/{self.shard_key(e['rank'])}"
        path = self.store.local_path(key)
        if path is None:
            buf = bytearray(self.store.read_range(key, e["offset"], e["nbytes"]))
        else:
            buf = bytearray(e["nbytes"])
            with open(path, "rb") as f:
                f.seek(e["offset"])
                if f.readinto(buf) != e["nbytes"]:
                    raise ConfigError("CKPT", f"{key}: ends inside {e['name']}")
        dtype = getattr(torch, e["dtype"])
        return torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)


    def spec(self, name: str):
        shape = self.reader.global_shape(f"model/{name}")
        if ".linear_fc1." in name and len(shape) == 3:
            shape = (shape[0] * shape[1], shape[2])
        return tuple(shape), getattr(torch, self.reader.pieces[f"model/{name}"][0]["dtype"])


class Merged(Source):
    """A base's tensors with LoRA adapters merged in: W + scale * B @ A (computed in fp32, stored in W's dtype)
    for every adapted linear, `pairs` {canonical linear name: (A, B)}."""

    def __init__(self, base: Source, pairs: dict, scale: float):
        self.base, self.pairs, self.scale, self.names = base, pairs, scale, base.names

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.base[name]
        pair = self.pairs.get(name.removesuffix(".weight")) if name.endswith(".weight") else None
        if pair is None:
            return w
        a, b = pair
        return (w.float() + self.scale * (b.float() @ a.float())).to(w.dtype)


    def spec(self, name: str):
        return self.base.spec(name)

    def close(self) -> None:
        self.base.close()
