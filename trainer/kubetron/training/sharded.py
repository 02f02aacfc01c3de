"""`checkpoint.ckpt_format: sharded` (the default): every rank writes only its own part of the canonical
tensors, straight into the store, and reads back only the parts its own layout needs.

    iter_0000020/shards/rank_00003.bin    raw tensor bytes (no pickle: nothing in it can run code)
    iter_0000020/shards/rank_00003.json   its index: per piece the canonical name, dtype, global shape,
                                          the box [start, stop) per dimension it covers, byte offset
    iter_0000020/common.pt ...            rank 0: counters, scheduler, data position, param groups

Canonical names and shapes are those of a TP=1/PP=1 model (sharding.py); a piece is a box of the global
tensor, so any layout reads any other's pieces by intersecting boxes:
- TP: a split parameter's box starts at `tp_rank * local size` along its partition_dim. SwiGLU's fc1
  (`[gate_r; up_r]` on each TP rank) is viewed as (2, ffn, ...) so its TP part is a box too.
- DP (and TP for replicated tensors): the replicas split the local tensor along its first dimension
  (contiguous slices), so each rank writes ~1/world of the bytes and no byte twice.
- PP: layer numbers are global; the last stage's copy of a tied output layer is not saved (it loads the
  word embedding).
- The padded vocabulary (it grows with TP): rows a checkpoint lacks are padding and load as zeros; rows
  it has beyond this run's padded size are skipped.
Optimizer state is saved per parameter like the parameter (param-shaped state such as Adam's moments and
fp32 `main_param`); 0-d tensors (`step`) are pieces with an empty box; other values go in the index.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from megatron.core import parallel_state

from kubetron.errors import CheckpointError
from kubetron.training import sharding

VOCAB_TENSORS = (sharding._WORD_EMBEDDING, "output_layer.weight")
MERGE_GAP = 4 << 20  # bytes: neighbouring ranges of one shard file closer than this are read as one


def shard_key(rank: int) -> str:
    return f"shards/rank_{rank:05d}.bin"


def index_key(rank: int) -> str:
    return f"shards/rank_{rank:05d}.json"


@dataclass
class Piece:
    """One box of one canonical tensor that this rank writes; `data` is a host copy."""

    name: str  # "model/<canonical name>" or "optim/<canonical name>/<state key>"
    global_shape: tuple[int, ...]
    box: list[tuple[int, int]]
    data: torch.Tensor


@dataclass
class RankShard:
    """What one rank writes: its pieces and the non-tensor optimizer values it owns."""

    pieces: list[Piece] = field(default_factory=list)
    values: dict[str, object] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() * p.data.element_size() for p in self.pieces)


# --- placement: where a local tensor sits in its canonical tensor ------------------------------------

def _placement(chunk, name: str, t: torch.Tensor, params: dict):
    """(t in canonical view, global shape, start per dim, TP-split dim or None)."""
    dim = sharding._tp_split(params.get(name))
    if sharding._is_gated_fc1(chunk, name) and t.ndim >= 1:
        t = t.view(2, t.shape[0] // 2, *t.shape[1:])  # [gate; up]: TP splits the second dimension
        dim = None if dim is None else dim + 1
    shape, start = list(t.shape), [0] * t.ndim
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if dim is not None and tp > 1:
        start[dim] = parallel_state.get_tensor_model_parallel_rank() * t.shape[dim]
        shape[dim] *= tp
    return t, tuple(shape), tuple(start), dim


def _replica_slot(tp_split: bool) -> tuple[int, int]:
    """(my index, count) among the ranks that hold the same local tensor."""
    dp_rank = parallel_state.get_data_parallel_rank()
    dp = parallel_state.get_data_parallel_world_size()
    if tp_split:
        return dp_rank, dp
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return dp_rank * tp + parallel_state.get_tensor_model_parallel_rank(), dp * tp


def _my_piece(name, t, gshape, start, dim, host_copy) -> Piece | None:
    """This rank's share of the local tensor `t` (a view in canonical layout), or None."""
    slot, n = _replica_slot(dim is not None)
    if t.ndim == 0:
        return Piece(name, (), [], host_copy(name, t)) if slot == 0 else None
    # Split the replicas' work along the first dimension long enough: a contiguous slice (a plain
    # memcpy into the host buffer, whole rows on load); the largest dimension if none is.
    d = next((i for i in range(t.ndim) if t.shape[i] >= n), max(range(t.ndim), key=lambda i: t.shape[i]))
    lo, hi = t.shape[d] * slot // n, t.shape[d] * (slot + 1) // n
    if hi <= lo:
        return None
    box = [(s + (lo if i == d else 0), s + (hi if i == d else t.shape[i])) for i, s in enumerate(start)]
    return Piece(name, gshape, box, host_copy(name, t.narrow(d, lo, hi - lo)))


# --- save -------------------------------------------------------------------------------------------

def snapshot(model, optim_by_name: dict | None, host_copy, keep=None) -> RankShard:
    """This rank's pieces of the model (and optimizer state keyed by local parameter name), on the host;
    `keep(name)` selects the model tensors (LoRA: the adapters only)."""
    chunk = model[0]
    params = dict(chunk.named_parameters())
    offsets = sharding._layer_offsets(chunk)
    out = RankShard()
    for k, v in sharding._local_state(chunk, keep).items():
        if sharding._is_tied_output_copy(chunk, k):
            continue
        t, gshape, start, dim = _placement(chunk, k, v.detach(), params)
        piece = _my_piece(f"model/{sharding._canonical_name(k, offsets)}", t, gshape, start, dim, host_copy)
        if piece is not None:
            out.pieces.append(piece)
    for k, state in (optim_by_name or {}).items():
        if sharding._is_tied_output_copy(chunk, k):
            continue
        base = f"optim/{sharding._canonical_name(k, offsets)}"
        for key, v in state.items():
            if torch.is_tensor(v) and v.ndim > 0:
                t, gshape, start, dim = _placement(chunk, k, v.detach().reshape(params[k].shape), params)
                piece = _my_piece(f"{base}/{key}", t, gshape, start, dim, host_copy)
            elif torch.is_tensor(v):
                piece = _my_piece(f"{base}/{key}", v.detach(), (), (), None, host_copy)
            else:
                piece = None
                if _replica_slot(False)[0] == 0:
                    out.values[f"{base}/{key}"] = v
            if piece is not None:
                out.pieces.append(piece)
    return out


def write(txn, rank: int, shard: RankShard, after_data=None) -> int:
    """Stream this rank's pieces into the transaction (no pickle, no staging); returns bytes written."""
    entries, offset = [], 0
    with txn.open_write(shard_key(rank)) as f:
        for p in shard.pieces:
            raw = p.data.contiguous().view(-1).view(torch.uint8).numpy()
            f.write(memoryview(raw))
            entries.append({"name": p.name, "dtype": str(p.data.dtype).removeprefix("torch."),
                            "global_shape": list(p.global_shape), "box": [list(b) for b in p.box],
                            "offset": offset, "nbytes": raw.nbytes})
            offset += raw.nbytes
    if after_data is not None:
        after_data()
    txn.write_bytes(index_key(rank), json.dumps({"rank": rank, "pieces": entries, "values": shard.values}).encode())
    return offset


# --- load -------------------------------------------------------------------------------------------

class ShardReader:
    """Reads boxes of canonical tensors from a sharded checkpoint: every index (small), then only the
    byte ranges (whole rows of each saved piece) that overlap what this rank asks for."""

    def __init__(self, store, name: str, num_shards: int):
        self.store, self.name = store, name
        self.pieces: dict[str, list[dict]] = {}
        self.values: dict[str, object] = {}
        for r in range(num_shards):
            key = f"{name}/{index_key(r)}"
            try:
                index = json.loads(store.read_bytes(key))
            except (FileNotFoundError, ValueError) as e:
                raise CheckpointError(f"cannot read {key}: {e}") from None
            for e in index["pieces"]:
                self.pieces.setdefault(e["name"], []).append({**e, "rank": r})
            self.values.update(index["values"])

    def has(self, name: str) -> bool:
        return name in self.pieces

    def keys_under(self, prefix: str) -> list[str]:
        return sorted({n[len(prefix):] for n in [*self.pieces, *self.values] if n.startswith(prefix)})

    def global_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.pieces[name][0]["global_shape"])

    def read_many(self, wants: list[tuple[str, list[tuple[int, int]]]]) -> list[torch.Tensor]:
        """The boxes asked for (name, box), in order. Byte ranges are planned first and fetched per shard
        file in few large reads (neighbours closer than MERGE_GAP merged), then cut into the boxes."""
        parts = [self._parts(name, box) for name, box in wants]
        blobs = self._fetch([(e["rank"], lo, hi) for ps in parts for e, _, lo, hi in ps])
        out = []
        for (name, box), ps in zip(wants, parts, strict=True):
            entries = self.pieces[name]
            t = torch.zeros([hi - lo for lo, hi in box], dtype=getattr(torch, entries[0]["dtype"]))
            for e, inter, lo, hi in ps:
                t[tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(inter, box, strict=True))] = \
                    _cut(e, inter, blobs(e["rank"], lo, hi))
            covered = sum(_numel(inter) for _, inter, _, _ in ps)
            if covered != t.numel():
                self._check_padding(name, box, covered)
            out.append(t)
        return out

    def _parts(self, name: str, box):
        """(entry, intersection, byte start, byte end) for each saved piece overlapping `box`; whole
        rows of the piece's first dimension, so each is one contiguous byte range."""
        parts = []
        for e in self.pieces[name]:
            inter = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(box, e["box"], strict=True)]
            if any(lo >= hi for lo, hi in inter):
                continue
            if not inter:  # a 0-d tensor
                parts.append((e, inter, e["offset"], e["offset"] + e["nbytes"]))
                continue
            row = e["nbytes"] // max(e["box"][0][1] - e["box"][0][0], 1)
            r0, r1 = inter[0][0] - e["box"][0][0], inter[0][1] - e["box"][0][0]
            parts.append((e, inter, e["offset"] + r0 * row, e["offset"] + r1 * row))
        return parts

    def _fetch(self, ranges):
        """Read the byte ranges, merged per file; returns get(rank, lo, hi) -> memoryview."""
        merged: dict[int, list[list[int]]] = {}
        for rank, lo, hi in sorted(set(ranges)):
            spans = merged.setdefault(rank, [])
            if spans and lo - spans[-1][1] <= MERGE_GAP:
                spans[-1][1] = max(spans[-1][1], hi)
            else:
                spans.append([lo, hi])
        data = {(rank, lo): memoryview(self.store.read_range(f"{self.name}/{shard_key(rank)}", lo, hi - lo))
                for rank, spans in merged.items() for lo, hi in spans}
        starts = {rank: [lo for lo, _ in spans] for rank, spans in merged.items()}

        def get(rank, lo, hi):
            s = max(x for x in starts[rank] if x <= lo)
            return data[(rank, s)][lo - s:hi - s]

        return get

    def _check_padding(self, name: str, box, covered: int):
        """Only rows beyond the saved (padded) vocabulary may be missing."""
        gshape = self.global_shape(name)
        inside = [(lo, min(hi, g)) for (lo, hi), g in zip(box, gshape, strict=True)]
        if name.split("/")[1] not in VOCAB_TENSORS or covered != _numel(inside):
            raise CheckpointError(f"{self.name}: {name} box {box} is not covered by the checkpoint "
                                  f"(saved global shape {list(gshape)})")


def _cut(e: dict, inter, raw: memoryview) -> torch.Tensor:
    """The intersection `inter` out of the whole rows `raw` of saved piece `e`."""
    dtype = getattr(torch, e["dtype"])
    if not inter:
        return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(())
    sizes = [hi - lo for lo, hi in e["box"]]
    t = torch.frombuffer(bytearray(raw), dtype=dtype).reshape([inter[0][1] - inter[0][0], *sizes[1:]])
    rest = tuple(slice(lo - s, hi - s) for (lo, hi), (s, _) in zip(inter[1:], e["box"][1:], strict=True))
    return t[(slice(None), *rest)]


def _numel(box) -> int:
    n = 1
    for lo, hi in box:
        n *= max(hi - lo, 0)
    return n


def _check_shape(reader, src: str, gshape, dim0_may_differ: bool):
    saved = reader.global_shape(src)
    if saved == tuple(gshape) or (dim0_may_differ and saved[1:] == tuple(gshape)[1:]):
        return
    raise CheckpointError(f"{reader.name}: {src} has global shape {list(saved)}, this model "
                          f"{list(gshape)}")


def _local_box(start, t) -> list[tuple[int, int]]:
    return [(s, s + n) for s, n in zip(start, t.shape, strict=True)]


def load_model(model, reader: ShardReader, keep=None):
    """Copy this rank's boxes of the canonical tensors into its parameters (and buffers); `keep(name)`
    selects which (LoRA: the base from a full checkpoint, the adapters from an adapter-only one)."""
    chunk = model[0]
    params = dict(chunk.named_parameters())
    offsets = sharding._layer_offsets(chunk)
    own = sharding._local_state(chunk, keep)
    wanted = {k: "model/" + sharding._source_name(chunk, k, offsets) for k in own}
    missing = sorted(v for v in wanted.values() if not reader.has(v))
    if missing:
        raise CheckpointError(f"{reader.name} lacks tensors this model has: {missing[:3]}")
    targets, wants = [], []
    for k, v in own.items():
        t, gshape, start, _ = _placement(chunk, k, v, params)
        _check_shape(reader, wanted[k], gshape, wanted[k].split("/")[1] in VOCAB_TENSORS)
        targets.append(t)
        wants.append((wanted[k], _local_box(start, t)))
    with torch.no_grad():
        for t, data in zip(targets, reader.read_many(wants), strict=True):
            t.copy_(data.to(t.dtype))


def load_optimizer(model, reader: ShardReader) -> dict:
    """This rank's optimizer state keyed by local parameter name (full local tensors), for
    checkpointing.load_optimizer_state_by_name."""
    chunk = model[0]
    offsets = sharding._layer_offsets(chunk)
    params = dict(chunk.named_parameters())
    state: dict[str, dict] = {}
    slots, wants = [], []
    for k, p in params.items():
        src = sharding._source_name(chunk, k, offsets)
        base = f"optim/{src}/"
        for key in reader.keys_under(base):
            name = base + key
            if name in reader.values:
                state.setdefault(k, {})[key] = reader.values[name]
                continue
            box = []
            if reader.global_shape(name):
                t, gshape, start, _ = _placement(chunk, k, torch.empty(p.shape, device="meta"), params)
                _check_shape(reader, name, gshape, src in VOCAB_TENSORS)
                box = _local_box(start, t)
            slots.append((k, key, p.shape if box else ()))
            wants.append((name, box))
    for (k, key, shape), data in zip(slots, reader.read_many(wants), strict=True):
        state.setdefault(k, {})[key] = data.reshape(shape)
    return state


def read_canonical(store, name: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """A whole sharded checkpoint as canonical tensors: ({name: tensor}, {param name: {state key: value}})
    (for tools and tests; a training load reads only its own boxes)."""
    import io

    common = torch.load(io.BytesIO(store.read_bytes(f"{name}/common.pt")), map_location="cpu", weights_only=True)
    reader = ShardReader(store, name, common["num_shards"])
    names = sorted(reader.pieces)
    full = reader.read_many([(n, [(0, g) for g in reader.global_shape(n)]) for n in names])
    model, optim = {}, {}
    for n, t in zip(names, full, strict=True):
        kind, rest = n.split("/", 1)
        if kind == "model":
            model[rest] = t
        else:
            param, key = rest.rsplit("/", 1)
            optim.setdefault(param, {})[key] = t
    for n, v in reader.values.items():
        param, key = n.split("/", 1)[1].rsplit("/", 1)
        optim.setdefault(param, {})[key] = v
    return model, optim
