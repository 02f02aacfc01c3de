"""The sharded checkpoint format's reader on its own: boxes written by two "ranks" read back as any box.

The end-to-end cases (DP/TP/PP resharding, SIGKILL during saves) are in tests/test_multirank.py; this
covers what a layout change can ask of the reader in one process: a box spanning both ranks' pieces,
vocabulary rows the checkpoint lacks (padding: zeros), and a box no piece covers (refused).
"""

from __future__ import annotations

import pytest
import torch
from kubetron.errors import CheckpointError
from kubetron.storage import open_store
from kubetron.training.sharded import Piece, RankShard, ShardReader, write

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
