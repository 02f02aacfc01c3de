"""The sharded checkpoint format's reader on its own: boxes written by two "ranks" read back as any box.

The end-to-end cases (DP/TP/PP resharding, SIGKILL during saves) are in tests/test_multirank.py; this
covers what a layout change can ask of the reader in one process: a box spanning both ranks' pieces,
vocabulary rows the checkpoint lacks (padding: zeros), and a box no piece covers (refused); and the
flat ranges a DP-sharded optimizer owns, written as boxes and read back as other ranges.
"""

from __future__ import annotations

import pytest
import torch
from kubetron.checkpoint.format_sharded import Piece, RankShard, ShardReader, flat_boxes, write
from kubetron.contract.errors import CheckpointError
from kubetron.storage import open_store

pytestmark = pytest.mark.unit

WORD = "model/embedding.word_embeddings.weight"
FC2 = "model/decoder.layers.0.mlp.linear_fc2.weight"


@pytest.fixture
def saved(tmp_path):
    """A (6, 4) embedding and a (3, 5) weight, rows split between rank 0 and rank 1, committed."""
    store = open_store(tmp_path / "store")
    emb = torch.arange(24, dtype=torch.float32).view(6, 4)
    fc2 = torch.arange(15, dtype=torch.bfloat16).view(3, 5)
    txn = store.begin_dir("iter_0000001")
    for rank, (lo, hi), (a, b) in ((0, (0, 4), (0, 1)), (1, (4, 6), (1, 3))):
        shard = RankShard([Piece(WORD, (6, 4), [(lo, hi), (0, 4)], emb[lo:hi]),
                           Piece(FC2, (3, 5), [(a, b), (0, 5)], fc2[a:b]),
                           Piece("optim/x/step", (), [], torch.tensor(7.0))] if rank == 0 else
                          [Piece(WORD, (6, 4), [(lo, hi), (0, 4)], emb[lo:hi]),
                           Piece(FC2, (3, 5), [(a, b), (0, 5)], fc2[a:b])],
                          values={"optim/x/lr": 0.5} if rank == 0 else {})
        assert write(txn, rank, shard) == shard.nbytes
    txn.commit(b"{}")
    return store, emb, fc2


def test_boxes_across_ranks_padding_and_gaps(saved):
    store, emb, fc2 = saved
    reader = ShardReader(store, "iter_0000001", 2)
    across, cols, step, padded = reader.read_many([
        (WORD, [(2, 6), (1, 3)]),      # rows from both ranks, a column slice
        (FC2, [(0, 3), (2, 5)]),       # bf16 kept
        ("optim/x/step", []),          # a 0-d piece
        (WORD, [(4, 8), (0, 4)]),      # a larger padded vocabulary: rows 6, 7 are padding
    ])
    assert torch.equal(across, emb[2:6, 1:3])
    assert cols.dtype == torch.bfloat16 and torch.equal(cols, fc2[:, 2:5])
    assert step.item() == 7.0 and reader.values["optim/x/lr"] == 0.5
    assert torch.equal(padded[:2], emb[4:6]) and not padded[2:].any()
    with pytest.raises(CheckpointError, match="linear_fc2.weight box .* is not covered"):
        reader.read_many([(FC2, [(0, 4), (0, 5)])])  # not a vocabulary tensor: no padding allowed


def test_boxes_read_straight_into_targets_as_read_many_reads_them(saved):
    """read_into (a model's load): the same values as read_many, copied into the targets in place (any dtype,
    a view of a larger tensor), the rows a padded vocabulary lacks zeroed, a wrong target or box refused."""
    store, emb, fc2 = saved
    reader = ShardReader(store, "iter_0000001", 2)
    wants = [(WORD, [(2, 6), (1, 3)]), (FC2, [(0, 3), (2, 5)]), ("optim/x/step", []), (WORD, [(4, 8), (0, 4)])]
    big = torch.full((4, 8), -1.0)  # the first target is a view: columns 2-3 of it
    targets = [big[:, 2:4], torch.full((3, 3), -1.0), torch.tensor(-1.0, dtype=torch.float64), torch.full((4, 4), -1.0)]
    reader.read_into(wants, targets)
    for got, want in zip(targets, reader.read_many(wants), strict=True):
        assert torch.equal(got, want.to(got.dtype))
    assert (big[:, :2] == -1).all() and (big[:, 4:] == -1).all()  # nothing outside the view written
    assert not targets[3][2:].any()  # padding rows: zeros, as read_many gives them
    with pytest.raises(CheckpointError, match="read into a tensor of shape"):
        reader.read_into([(FC2, [(0, 3), (2, 5)])], [torch.empty(3, 4)])
    with pytest.raises(CheckpointError, match="linear_fc2.weight box .* is not covered"):
        reader.read_into([(FC2, [(0, 4), (0, 5)])], [torch.empty(4, 5)])


@pytest.mark.parametrize("shape", [(7,), (5, 6), (2, 3, 4), (3, 1, 5), (1, 4)])
def test_flat_ranges_are_exact_boxes(shape):
    """Every flat range [lo, hi) of a C-contiguous tensor becomes boxes whose elements, in order, are
    exactly that range (at most 2·ndim - 1 of them)."""
    t = torch.arange(torch.Size(shape).numel()).view(shape)
    n = t.numel()
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            boxes = flat_boxes(shape, lo, hi)
            assert len(boxes) <= max(2 * len(shape) - 1, 1)
            got = [t[tuple(slice(a, b) for a, b in box)].reshape(-1) for box, _, _ in boxes]
            assert torch.equal(torch.cat(got) if got else torch.empty(0, dtype=t.dtype), t.reshape(-1)[lo:hi])
            assert [a for _, a, _ in boxes] == sorted(a for _, a, _ in boxes)
            assert all(b - a == x.numel() for (_, a, b), x in zip(boxes, got, strict=True))


def test_flat_ranges_of_three_ranks_read_back_as_other_ranges(tmp_path):
    """A (5, 6) tensor's state split at flat offsets 0 | 8 | 19 | 30 (ranks 0..2, ranges cutting rows) is
    read back whole, as rows, and as other flat ranges (a DP=2 run resuming a DP=3 distributed optimizer)."""
    store = open_store(tmp_path / "store")
    full = torch.randn(5, 6)
    txn = store.begin_dir("iter_0000001")
    for rank, (lo, hi) in enumerate(((0, 8), (8, 19), (19, 30))):
        flat = full.reshape(-1)[lo:hi]
        pieces = [Piece("optim/w/exp_avg", (5, 6), box, flat[a - lo:b - lo].view([y - x for x, y in box]))
                  for box, a, b in flat_boxes((5, 6), lo, hi)]
        write(txn, rank, RankShard(pieces))
    txn.commit(b"{}")
    reader = ShardReader(store, "iter_0000001", 3)
    whole, rows = reader.read_many([("optim/w/exp_avg", [(0, 5), (0, 6)]), ("optim/w/exp_avg", [(1, 3), (2, 6)])])
    assert torch.equal(whole, full) and torch.equal(rows, full[1:3, 2:6])
    for lo, hi in ((0, 15), (15, 30), (3, 4), (11, 29)):
        boxes = flat_boxes((5, 6), lo, hi)
        parts = reader.read_many([("optim/w/exp_avg", box) for box, _, _ in boxes])
        assert torch.equal(torch.cat([p.reshape(-1) for p in parts]), full.reshape(-1)[lo:hi])


@pytest.mark.parametrize(
    ("shape", "view", "dim", "lo", "n", "fast"),
    [
        ((6, 5), (6, 5), None, 0, 0, True),  # the whole tensor
        ((6, 5), (6, 5), 0, 2, 3, True),  # rows: one contiguous run
        ((30,), (1, 6, 5), 1, 4, 2, True),  # viewed canonically, leading dimension 1: still one run
        ((6, 5), (6, 5), 1, 1, 3, False),  # columns: strided, the torch copy
        ((), (), None, 0, 0, True),  # a scalar
    ],
)
def test_a_cut_copies_exactly_its_box_on_both_copy_paths(shape, view, dim, lo, n, fast):
    from kubetron.checkpoint.format_sharded import _Cut
    from kubetron.checkpoint.hostcopy import HostBuffers

    live = torch.randn(shape)
    cut = _Cut("t", view, (), view, dim, lo, n)
    want = live.reshape(view) if dim is None else live.reshape(view).narrow(dim, lo, n)
    assert (cut.flat_range is not None) == fast
    buffers = HostBuffers()
    assert torch.equal(cut.take(live, buffers, "k").data, want)
    # in a batch the contiguous runs are queued and copied when the block ends, from the live tensor
    # at that moment (a snapshot changes nothing in between); a temporary source stays alive until then
    with buffers.batch():
        piece = cut.take(live * 2, buffers, "k")
        if fast and want.numel():
            assert not torch.equal(piece.data, want * 2)  # not copied yet
    assert torch.equal(piece.data, want * 2)
    # a block that raises copies nothing (the snapshot failed; the buffers are not a checkpoint)
    with pytest.raises(RuntimeError), buffers.batch():
        cut.take(live * 3, buffers, "k")
        raise RuntimeError("boom")
    assert torch.equal(piece.data, want * 2 if fast else want * 3)  # (the torch path copies at once)
    # a non-contiguous source takes the torch path too
    assert torch.equal(cut.take(live.t().contiguous().t(), buffers, "k").data, want)
