"""`checkpoint.ckpt_format: sharded` (the default): every rank writes only its own part of the canonical
tensors, straight into the store, and reads back only the parts its own layout needs.

    iter_0000020/shards/rank_00003.bin    raw tensor bytes (no pickle: nothing in it can run code)
    iter_0000020/shards/rank_00003.json   its index: per piece the canonical name, dtype, global shape,
                                          the box [start, stop) per dimension it covers, byte offset
    iter_0000020/common.pt ...            rank 0: counters, scheduler, data position, param groups

Canonical names and shapes are those of a TP=1/PP=1 model (canonical.py); a piece is a box of the global
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
An optimizer that shards its state over DP (ddp.DistributedOptimizer: each rank owns a flat range of
each parameter) writes and reads exactly the ranges it owns, as boxes (`flat_boxes`): no rank ever
holds a whole parameter's state, and the pieces are the same canonical tensors any layout reads.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from megatron.core import parallel_state

from kubetron.checkpoint import canonical
from kubetron.checkpoint.hostcopy import HostBuffers
from kubetron.checkpoint.layout import COMMON, MAX_INDEX, MAX_NDIM, TENSOR_DTYPES, brief, read_json, safe_load
from kubetron.contract.errors import CheckpointError

VOCAB_TENSORS = (canonical.WORD_EMBEDDING, "output_layer.weight")
MERGE_GAP = 4 << 20  # bytes: neighbouring ranges of one shard file closer than this are read as one
MAX_SHARDS = 1 << 20  # ranks: a checkpoint's num_shards above this is not one kubetron wrote


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


class ShardLike(Protocol):
    """What `write` streams: pieces (a RankShard's, or made as they are written) and non-tensor values."""

    @property
    def pieces(self) -> Iterable[Piece]: ...

    @property
    def values(self) -> dict[str, object]: ...


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
    dim = canonical.tp_split(params.get(name))
    if canonical.is_gated_fc1(chunk, name) and t.ndim >= 1:
        t = t.view(2, t.shape[0] // 2, *t.shape[1:])  # [gate; up]: TP splits the second dimension
        dim = None if dim is None else dim + 1
    shape, start = list(t.shape), [0] * t.ndim
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if dim is not None and tp > 1:
        start[dim] = parallel_state.get_tensor_model_parallel_rank() * t.shape[dim]
        shape[dim] *= tp
    return t, tuple(shape), tuple(start), dim


def _replica_slot(tp_split: bool, expert: bool = False) -> tuple[int, int]:
    """(my index, count) among the ranks that hold the same local tensor (an expert's under EP: the
    expert-data-parallel ranks, as the other EP ranks hold other experts)."""
    if expert and parallel_state.get_expert_model_parallel_world_size() > 1:
        dp_rank = parallel_state.get_expert_data_parallel_rank()
        dp = parallel_state.get_expert_data_parallel_world_size()
    else:
        dp_rank = parallel_state.get_data_parallel_rank()
        dp = parallel_state.get_data_parallel_world_size()
    if tp_split:
        return dp_rank, dp
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return dp_rank * tp + parallel_state.get_tensor_model_parallel_rank(), dp * tp


@dataclass(frozen=True)
class _Cut:
    """How one piece is cut out of a live tensor: view it as `shape` (canonical layout), take
    [lo, lo + n) of dimension `dim` (None: all of it); it lands at `box` of canonical tensor `name`.
    Depends only on the model and the parallel layout, so a CheckpointManager computes it once."""

    name: str
    global_shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]
    shape: tuple[int, ...]
    dim: int | None = None
    lo: int = 0
    n: int = 0

    @cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached_property
    def flat_range(self) -> tuple[int, tuple[int, ...]] | None:
        """(first element, piece shape) when the piece is one run of the C-contiguous canonical view."""
        if self.dim is None:
            return 0, self.shape
        if math.prod(self.shape[: self.dim]) != 1:
            return None
        inner = math.prod(self.shape[self.dim + 1 :])
        return self.lo * inner, (*self.shape[: self.dim], self.n, *self.shape[self.dim + 1 :])

    def take(self, t: torch.Tensor, buffers: HostBuffers, key: str) -> Piece:
        run = self.flat_range
        if run is not None and t.is_cpu and t.is_contiguous() and t.numel() == self.numel:
            # the common case: one memmove from a computed offset, no view built (what an async save
            # blocks for is the copies, so the per-piece Python is kept to a few attribute reads)
            data = buffers.copy_range(key, t, run[0], run[1])
        else:
            t = t.detach()
            t = t.reshape(self.shape) if t.shape != self.shape else t
            if self.dim is not None:
                t = t.narrow(self.dim, self.lo, self.n)
            data = buffers.copy(key, t)
        return Piece(self.name, self.global_shape, list(self.box), data)


def _my_cut(name, t, gshape, start, dim) -> _Cut | None:
    """This rank's share of the local tensor `t` (a view in canonical layout), or None."""
    slot, n = _replica_slot(dim is not None, canonical.is_expert(name))
    if t.ndim == 0:
        return _Cut(name, (), (), ()) if slot == 0 else None
    # Split the replicas' work along the first dimension long enough: a contiguous slice (a plain
    # memcpy into the host buffer, whole rows on load); the largest dimension if none is.
    d = next((i for i in range(t.ndim) if t.shape[i] >= n), max(range(t.ndim), key=lambda i: t.shape[i]))
    lo, hi = t.shape[d] * slot // n, t.shape[d] * (slot + 1) // n
    if hi <= lo:
        return None
    box = tuple((s + (lo if i == d else 0), s + (hi if i == d else t.shape[i])) for i, s in enumerate(start))
    return _Cut(name, gshape, box, tuple(t.shape), d, lo, hi - lo)


def flat_boxes(shape, lo: int, hi: int) -> list[tuple[list[tuple[int, int]], int, int]]:
    """The flat range [lo, hi) of a C-contiguous tensor of `shape` as boxes, in order: [(box, a, b)],
    box b holding the elements [a, b) of the flat range (at most 2·ndim - 1 boxes)."""
    if hi <= lo:
        return []
    if not shape:
        return [([], lo, hi)]
    inner = 1
    for n in shape[1:]:
        inner *= n

    def within_row(row, a, b):  # part of one row: a box of the inner shape, one row high
        return [([(row, row + 1), *box], row * inner + x, row * inner + y)
                for box, x, y in flat_boxes(shape[1:], a - row * inner, b - row * inner)]

    first, last = lo // inner, (hi - 1) // inner
    if first == last and (lo % inner or hi - lo < inner):
        return within_row(first, lo, hi)
    full_lo, full_hi = -(-lo // inner), hi // inner  # the whole rows inside [lo, hi)
    out = within_row(first, lo, full_lo * inner) if lo % inner else []
    if full_hi > full_lo:
        out.append(([(full_lo, full_hi), *[(0, n) for n in shape[1:]]], full_lo * inner, full_hi * inner))
    if hi % inner:
        out += within_row(last, full_hi * inner, hi)
    return out


# --- save -------------------------------------------------------------------------------------------

def snapshot(model, optim_by_name: dict | None, buffers: HostBuffers, keep=None, owned=None,
             plan: dict | None = None) -> RankShard:
    """This rank's pieces of the model (and optimizer state keyed by local parameter name, or `owned`:
    the flat ranges of a DP-sharded optimizer, see _Layout.owned_cuts), on the host; `keep(name)` selects
    the model tensors (LoRA: the adapters only). `plan`: a dict the caller keeps from one save to the
    next (same model, same layout): where each tensor's pieces go is worked out once, so a later
    snapshot (what an async save blocks for) is little more than the copies."""
    chunk = model[0]
    plan = {} if plan is None else plan
    layout = _Layout(chunk)
    out = RankShard()
    for k, v in canonical.local_state(chunk, keep).items():
        cut = _planned(plan, ("model", k, tuple(v.shape)), lambda k=k, v=v: layout.model_cut(k, v))
        if cut is not None:
            out.pieces.append(cut.take(v, buffers, cut.name))
    for k, state in (optim_by_name or {}).items():
        for key, v in state.items():
            if not torch.is_tensor(v):
                if not layout.is_tied_copy(k) and _replica_slot(False, canonical.is_expert(k))[0] == 0:
                    out.values[f"{layout.base(k)}/{key}"] = v
                continue
            cut = _planned(plan, ("optim", k, key, tuple(v.shape)),
                           lambda k=k, key=key, v=v: layout.optim_cut(k, key, v))
            if cut is not None:
                out.pieces.append(cut.take(v, buffers, cut.name))
    for p, lo, hi, state in owned or ():
        for key, v in state.items():
            if not torch.is_tensor(v):
                if layout.writes_scalars(p, lo):
                    out.values[f"{layout.base(layout.names[p])}/{key}"] = v
                continue
            cuts = _planned(plan, ("owned", id(p), key, lo, hi, v.ndim),
                            lambda p=p, key=key, lo=lo, hi=hi, v=v: layout.owned_cuts(p, key, lo, hi, v))
            flat = v.reshape(-1) if v.ndim else v
            for cut, a, n in cuts:
                out.pieces.append(cut.take(flat.narrow(0, a, n) if v.ndim else flat, buffers, f"{cut.name}@{a}"))
    return out


_MISS = object()


def _planned(plan: dict, key, compute):
    hit = plan.get(key, _MISS)
    if hit is _MISS:
        hit = plan[key] = compute()
    return hit


class _Layout:
    """Where this rank's tensors sit in the canonical tensors (computed on a plan miss only)."""

    def __init__(self, chunk):
        self.chunk = chunk
        self._params = self._names = self._offsets = None

    @property
    def params(self) -> dict:
        if self._params is None:
            self._params = dict(self.chunk.named_parameters())
        return self._params

    @property
    def names(self) -> dict:
        if self._names is None:
            self._names = {p: k for k, p in self.params.items()}
        return self._names

    def canonical(self, k: str) -> str:
        if self._offsets is None:
            self._offsets = canonical.layer_offsets(self.chunk)
        return canonical.canonical_name(k, self._offsets)

    def base(self, k: str) -> str:
        return f"optim/{self.canonical(k)}"

    def is_tied_copy(self, k: str) -> bool:
        return canonical.is_tied_output_copy(self.chunk, k)

    def model_cut(self, k: str, v: torch.Tensor) -> _Cut | None:
        if self.is_tied_copy(k):
            return None
        t, gshape, start, dim = _placement(self.chunk, k, v.detach(), self.params)
        return _my_cut(f"model/{self.canonical(k)}", t, gshape, start, dim)

    def optim_cut(self, k: str, key: str, v: torch.Tensor) -> _Cut | None:
        """Per-parameter optimizer state: param-shaped tensors like the parameter, 0-d ones once."""
        if self.is_tied_copy(k):
            return None
        name = f"{self.base(k)}/{key}"
        if v.ndim == 0:
            return _my_cut(name, v, (), (), None)
        return _my_cut(name, *_param_placement(self.chunk, k, self.params))

    def writes_scalars(self, p, lo: int) -> bool:
        """A DP-sharded optimizer's 0-d and non-tensor values of a parameter: written once, by TP rank 0's
        owner of element 0 (replicated over TP, only TP rank 0's DP group writes at all)."""
        return lo == 0 and parallel_state.get_tensor_model_parallel_rank() == 0 \
            and not self.is_tied_copy(self.names[p])

    def owned_cuts(self, p, key: str, lo: int, hi: int, v: torch.Tensor) -> list[tuple[_Cut, int, int]]:
        """The flat range [lo, hi) of parameter `p`'s state `key` as boxes: [(cut, offset, length) of
        each box's slice of the range]."""
        k = self.names[p]
        replicated_elsewhere = parallel_state.get_tensor_model_parallel_rank() != 0 and canonical.tp_split(p) is None
        if self.is_tied_copy(k) or replicated_elsewhere:
            return []
        name = f"{self.base(k)}/{key}"
        if v.ndim == 0:
            return [(_Cut(name, (), (), ()), 0, 0)] if self.writes_scalars(p, lo) else []
        t, gshape, start, _ = _param_placement(self.chunk, k, self.params)
        return [(_Cut(name, gshape, tuple(_shifted(box, start)), tuple(y - x for x, y in box)), a - lo, b - a)
                for box, a, b in flat_boxes(t.shape, lo, hi)]


def _shifted(box, start) -> list[tuple[int, int]]:
    return [(s + x, s + y) for s, (x, y) in zip(start, box, strict=True)]


def write(txn, rank: int, shard: ShardLike, after_data=None) -> int:
    """Stream this rank's pieces into the transaction (no pickle, no staging); returns bytes written."""
    entries, offset = [], 0
    with txn.open_write(shard_key(rank)) as f:
        for p in shard.pieces:
            raw = p.data.contiguous().view(-1).view(torch.uint8).numpy()
            f.write(memoryview(raw))  # type: ignore[arg-type]  # (numpy's stubs: an ndarray is no Buffer)
            entries.append({"name": p.name, "dtype": str(p.data.dtype).removeprefix("torch."),
                            "global_shape": list(p.global_shape), "box": [list(b) for b in p.box],
                            "offset": offset, "nbytes": raw.nbytes})
            offset += raw.nbytes
    if after_data is not None:
        after_data()
    txn.write_bytes(index_key(rank), json.dumps({"rank": rank, "pieces": entries, "values": shard.values}).encode())
    return offset


# --- load -------------------------------------------------------------------------------------------

def _count(v) -> bool:
    """A JSON number of things: an int, not a bool."""
    return type(v) is int and v >= 0


def _check_piece(e, key: str) -> dict:
    """One index entry, as format_sharded.write writes it, or a CheckpointError."""
    if not isinstance(e, dict) or not isinstance(e.get("name"), str) \
            or not e["name"].startswith(("model/", "optim/")) or e.get("dtype") not in TENSOR_DTYPES:
        raise CheckpointError(f"{key}: {brief(e)} is not a tensor piece (name, dtype)")
    shape, box = e.get("global_shape"), e.get("box")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_count(g) for g in shape) \
            or not isinstance(box, list) or len(box) != len(shape):
        raise CheckpointError(f"{key}: {e['name']} has no valid global shape and box")
    for b, g in zip(box, shape, strict=True):
        if not (isinstance(b, list) and len(b) == 2 and _count(b[0]) and _count(b[1]) and b[0] <= b[1] <= g):
            raise CheckpointError(f"{key}: {e['name']} box {brief(box)} is not inside {shape}")
    size = _numel(box) * TENSOR_DTYPES[e["dtype"]].itemsize
    if not (_count(e.get("offset")) and e.get("nbytes") == size):
        raise CheckpointError(f"{key}: {e['name']} declares {brief(e.get('nbytes'))} bytes at "
                              f"{brief(e.get('offset'))}; its box of {e['dtype']} holds {size}")
    return {k: e[k] for k in ("name", "dtype", "global_shape", "box", "offset", "nbytes")}


def _plain(v) -> bool:
    return v is None or type(v) in (bool, int, float, str)


def check_index(index, key: str) -> tuple[list[dict], dict]:
    """(pieces, values) of one rank's index, checked; its pieces' byte ranges may not overlap."""
    if not isinstance(index, dict) or not isinstance(index.get("pieces"), list) \
            or not isinstance(index.get("values"), dict):
        raise CheckpointError(f"{key}: not a shard index (pieces, values)")
    values = index["values"]
    bad = next((k for k, v in values.items() if not (k.startswith("optim/") and k.count("/") >= 2 and _plain(v))),
               None)
    if bad is not None:
        raise CheckpointError(f"{key}: value {brief(bad)} is not a plain optimizer value")
    pieces = [_check_piece(e, key) for e in index["pieces"]]
    end = 0
    for e in sorted(pieces, key=lambda e: e["offset"]):
        if e["offset"] < end:
            raise CheckpointError(f"{key}: {e['name']} overlaps another piece's bytes")
        end = e["offset"] + e["nbytes"]
    return pieces, values


def _check_consistent(name: str, entries: list[dict], where: str):
    """One canonical tensor's pieces (from every rank): one global shape and dtype, and together exactly
    its elements (none missing, none twice over)."""
    first = entries[0]
    if any(e["global_shape"] != first["global_shape"] or e["dtype"] != first["dtype"] for e in entries):
        raise CheckpointError(f"{where}: the pieces of {name} disagree on its shape or dtype")
    if sum(_numel(e["box"]) for e in entries) != math.prod(first["global_shape"]):
        raise CheckpointError(f"{where}: the pieces of {name} do not add up to its shape {first['global_shape']}")
    overlap = _overlapping([e["box"] for e in entries])  # adding up, two that overlap leave a gap elsewhere
    if overlap is not None:
        a, b = (entries[i] for i in overlap)
        raise CheckpointError(f"{where}: the pieces of {name} overlap: box {a['box']} of rank {a['rank']} and box "
                              f"{b['box']} of rank {b['rank']} (part of it would keep the values it had before)")


OVERLAP_TESTS = 50_000_000  # pairs of boxes _overlapping may compare: a checkpoint kubetron wrote needs a few per piece


def _overlapping(boxes: list) -> tuple[int, int] | None:
    """Two of `boxes` that share an element (their indices), or None. A sweep along the dimension where the boxes
    start at the most places: only boxes whose ranges there meet are compared (a tensor's pieces that kubetron wrote
    meet few others: rows of a flat shard, or a tensor-parallel split); a crafted set that would need more than
    OVERLAP_TESTS comparisons is refused."""
    kept = [i for i, box in enumerate(boxes) if _numel(box)]
    if len(kept) < 2 or not boxes[kept[0]]:
        return (kept[0], kept[1]) if len(kept) > 1 else None  # two pieces of a scalar
    d = max(range(len(boxes[kept[0]])), key=lambda k: len({boxes[i][k][0] for i in kept}))
    active: list[int] = []
    tests = 0
    for i in sorted(kept, key=lambda i: boxes[i][d][0]):
        box = boxes[i]
        active = [j for j in active if boxes[j][d][1] > box[d][0]]
        tests += len(active)
        if tests > OVERLAP_TESTS:
            raise CheckpointError(f"more than {OVERLAP_TESTS} pairs of pieces of one tensor to compare: not a "
                                  "checkpoint kubetron wrote")
        for j in active:
            if all(max(a, c) < min(b, e) for (a, b), (c, e) in zip(boxes[j], box, strict=True)):
                return j, i
        active.append(i)
    return None


class ShardReader:
    """Reads boxes of canonical tensors from a sharded checkpoint: every index (small), then only the
    byte ranges (whole rows of each saved piece) that overlap what this rank asks for.

    The indexes are hostile input, checked before anything is read or allocated from them (check_index,
    _check_consistent): every piece has a known dtype, a box inside its global shape and exactly
    numel x itemsize bytes; one file's pieces do not overlap; one tensor's pieces agree on shape and dtype
    and add up to it. A load then compares the global shapes with its model's, so what it reads and
    allocates is bounded by its model and by the shard files' real sizes (the store checks each byte range
    against its file before reading)."""

    def __init__(self, store, name: str, num_shards: object):  # (common.pt's entry: checked here)
        self.store, self.name = store, name
        self.pieces: dict[str, list[dict]] = {}
        self.values: dict[str, object] = {}
        if type(num_shards) is not int or not 1 <= num_shards <= MAX_SHARDS:
            raise CheckpointError(f"{name}/{COMMON}: num_shards {brief(num_shards)} is not a number of ranks")
        for r in range(num_shards):
            key = f"{name}/{index_key(r)}"
            try:
                index = read_json(store, key, MAX_INDEX)
            except FileNotFoundError as e:
                raise CheckpointError(f"cannot read {key}: {e}") from None
            pieces, values = check_index(index, key)
            for entry in pieces:
                self.pieces.setdefault(entry["name"], []).append({**entry, "rank": r})
            self.values.update(values)
        for n, entries in self.pieces.items():
            _check_consistent(n, entries, name)

    def has(self, name: str) -> bool:
        return name in self.pieces

    def keys_under(self, prefix: str) -> list[str]:
        return sorted({n[len(prefix):] for n in [*self.pieces, *self.values] if n.startswith(prefix)})

    def global_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.pieces[name][0]["global_shape"])

    def read_many(self, wants: list[tuple[str, list[tuple[int, int]]]]) -> list[torch.Tensor]:
        """The boxes asked for (name, box), in order, each a tensor of its own (zeros where a padded vocabulary lacks
        rows). Byte ranges are planned first and fetched per shard file in few large reads (neighbours closer than
        MERGE_GAP merged), then copied into the boxes (`read_into`)."""
        out = [torch.zeros([hi - lo for lo, hi in box], dtype=TENSOR_DTYPES[self.pieces[name][0]["dtype"]])
               for name, box in wants]
        self.read_into(wants, out)
        return out

    def read_into(self, wants: list[tuple[str, list[tuple[int, int]]]], targets: list[torch.Tensor]) -> None:
        """read_many, each box copied straight from the bytes read into its target (a tensor of the box's shape,
        of any dtype and device: a model's parameter): no tensor in between, no copy of the bytes (a load of a
        large replicated weight touches it once, not four times). Rows a padded vocabulary lacks become zeros."""
        parts = [self._parts(name, box) for name, box in wants]
        blobs = self._fetch([(e["rank"], lo, hi) for ps in parts for e, _, lo, hi in ps])
        for (name, box), ps, t in zip(wants, parts, targets, strict=True):
            if list(t.shape) != [hi - lo for lo, hi in box]:
                raise CheckpointError(f"{self.name}: {name}: box {box} read into a tensor of shape {list(t.shape)}")
            covered = sum(_numel(inter) for _, inter, _, _ in ps)
            if covered != t.numel():
                self._check_padding(name, box, covered)
                t.zero_()
            for e, inter, lo, hi in ps:
                t[tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(inter, box, strict=True))].copy_(
                    _view(e, inter, blobs(e["rank"], lo, hi)))

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
        reads = [(rank, lo, hi) for rank, rank_spans in merged.items() for lo, hi in rank_spans]
        blobs = self.store.read_ranges([(f"{self.name}/{shard_key(rank)}", lo, hi - lo) for rank, lo, hi in reads])
        data = {(rank, lo): memoryview(blob) for (rank, lo, _), blob in zip(reads, blobs, strict=True)}
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


def _view(e: dict, inter, raw) -> torch.Tensor:
    """The intersection `inter` out of the whole rows `raw` of saved piece `e`, as a view of `raw`'s bytes (read
    only: a store's answer may be immutable bytes; only ever copied from)."""
    dtype = TENSOR_DTYPES[e["dtype"]]
    with warnings.catch_warnings():  # "the given buffer is not writable": it is only read
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(raw, dtype=dtype)
    if not inter:
        return flat.reshape(())
    sizes = [hi - lo for lo, hi in e["box"]]
    t = flat.reshape([inter[0][1] - inter[0][0], *sizes[1:]])
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


def _param_placement(chunk, k: str, params: dict):
    """_placement of parameter `k` by its shape alone (for its optimizer state)."""
    return _placement(chunk, k, torch.empty(params[k].shape, device="meta"), params)


def _local_box(start, t) -> list[tuple[int, int]]:
    return [(s, s + n) for s, n in zip(start, t.shape, strict=True)]


def load_model(model, reader: ShardReader, keep=None):
    """Copy this rank's boxes of the canonical tensors into its parameters (and buffers); `keep(name)`
    selects which (LoRA: the base from a full checkpoint, the adapters from an adapter-only one)."""
    chunk = model[0]
    params = dict(chunk.named_parameters())
    offsets = canonical.layer_offsets(chunk)
    own = canonical.local_state(chunk, keep)
    wanted = {k: "model/" + canonical.source_name(chunk, k, offsets) for k in own}
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
        reader.read_into(wants, targets)


def load_optimizer(model, reader: ShardReader) -> dict:
    """This rank's optimizer state keyed by local parameter name (full local tensors), for
    canonical.load_optimizer_state_by_name."""
    params = dict(model[0].named_parameters())
    ranges = [(p, 0, p.numel()) for p in params.values()]
    state: dict[str, dict] = {}
    for (k, p), (_, _, _, st) in zip(params.items(), _read_ranges(model, reader, ranges), strict=True):
        if st:
            state[k] = {key: v.view(p.shape) if torch.is_tensor(v) and v.ndim else v for key, v in st.items()}
    return state


def load_owned(model, reader: ShardReader, ranges) -> list[tuple]:
    """For a DP-sharded optimizer: the state of the flat ranges this rank owns ([(param, lo, hi)]), read
    as boxes (no rank reads a whole parameter's state): [(param, lo, hi, {key: flat tensor or value})]."""
    return _read_ranges(model, reader, ranges, require=True)


def _read_ranges(model, reader: ShardReader, ranges, require: bool = False) -> list[tuple]:
    """[(param, lo, hi, {state key: flat tensor of elements [lo, hi), 0-d tensor or value})] for the
    flat ranges asked for, each read as its boxes; `require`: a parameter without saved optimizer state
    is an error (when the checkpoint has any)."""
    chunk = model[0]
    offsets = canonical.layer_offsets(chunk)
    params = dict(chunk.named_parameters())
    names = {p: k for k, p in params.items()}
    saved_any = require and any(n.startswith("optim/") for n in [*reader.pieces, *reader.values])
    out: list[tuple[torch.nn.Parameter, int, int, dict]] = []
    slots: list[tuple[dict, str, int]] = []  # (state, key, boxes): where each read lands
    wants: list[tuple[str, list]] = []  # (piece name, box) to read
    for p, lo, hi in ranges:
        k = names[p]
        src = canonical.source_name(chunk, k, offsets)
        base = f"optim/{src}/"
        keys = reader.keys_under(base)
        if saved_any and not keys:
            raise CheckpointError(f"{reader.name}: the optimizer state lacks {src}")
        state: dict = {}
        placed = None  # (global shape, start, boxes of [lo, hi)): the same for every state tensor of p
        for key in keys:
            name = base + key
            if name in reader.values:
                state[key] = reader.values[name]
            elif not reader.global_shape(name):  # 0-d (`step`)
                slots.append((state, key, 0))
                wants.append((name, []))
            else:
                if placed is None:
                    t, gshape, start, _ = _param_placement(chunk, k, params)
                    placed = gshape, start, flat_boxes(t.shape, lo, hi)
                gshape, start, boxes = placed
                _check_shape(reader, name, gshape, src in VOCAB_TENSORS)
                slots.append((state, key, len(boxes)))
                wants += [(name, _shifted(box, start)) for box, _, _ in boxes]
        out.append((p, lo, hi, state))
    data = iter(reader.read_many(wants))
    for state, key, n in slots:
        parts = [next(data).reshape(-1) for _ in range(max(n, 1))]
        state[key] = parts[0].reshape(()) if n == 0 else parts[0] if n == 1 else torch.cat(parts)
    return out


def read_canonical(store, name: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """A whole sharded checkpoint as canonical tensors: ({name: tensor}, {param name: {state key: value}})
    (for tools and tests; a training load reads only its own boxes)."""
    common = safe_load(store.read_bytes(f"{name}/{COMMON}", limit=MAX_INDEX), f"{name}/{COMMON}")
    reader = ShardReader(store, name, common.get("num_shards") if isinstance(common, dict) else None)
    names = sorted(reader.pieces)
    full = reader.read_many([(n, [(0, g) for g in reader.global_shape(n)]) for n in names])
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict] = {}
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
