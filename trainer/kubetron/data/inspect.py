"""``kubetron inspect-data``: the fine-tuning examples a run would train on, before any GPU time is spent.

The data is built exactly as the trainer builds it (:func:`kubetron.data.finetuning.build`: files, row formats, the
chat template, truncation, dropping, packing), in memory: nothing is written to the job's store or cache. Examples are
shown in the order packing put them into sequences (before the per-epoch shuffle):

* text (default): the data line (examples, dropped, cut, trained tokens, sequences), then each example's text with
  every trained span between ``⟦`` and ``⟧`` (special tokens written out);
* ``--json``: one JSON object per example and line, ``{"example", "row", "sequence", "ids", "loss_mask"}``, where
  ``loss_mask[j]`` is 1 when ``ids[j]`` is a token the model is trained to write (so ``loss_mask[0]`` is 0: no
  position predicts the first token), as transformers' ``assistant_masks`` and TRL's ``completion_mask`` are read;
  the data line goes to stderr.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import numpy as np

from kubetron.contract.errors import ConfigError

OPEN, CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧


def examples(built) -> Iterator[dict]:
    """Every example in packing order: its number, row, sequence, ids and loss mask."""
    a = built.arrays
    offsets, groups, group_offsets = a["offsets"], a["groups"], a["group_offsets"]
    n = 0
    for seq in range(len(group_offsets) - 1):
        for i in groups[group_offsets[seq]:group_offsets[seq + 1]]:
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            n += 1
            mask = a["flags"][lo:hi].astype(np.int64)
            mask[0] = 0
            yield {"example": n, "row": built.where[int(i)], "sequence": seq + 1,
                   "ids": a["tokens"][lo:hi].tolist(), "loss_mask": mask.tolist()}


def marked_text(tokenizer, ids: list[int], mask: list[int]) -> str:
    """The example's text, each run of trained tokens between OPEN and CLOSE."""
    decode = getattr(tokenizer, "decode_all", tokenizer.decode)
    out, start = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or mask[j] != mask[start]:
            text = decode(ids[start:j])
            out.append(f"{OPEN}{text}{CLOSE}" if mask[start] else text)
            start = j
    return "".join(out)


def run(cfg, limit: int, as_json: bool, out=sys.stdout, err=sys.stderr) -> int:
    """Build the training data of `cfg` and print `limit` examples (see the module docstring)."""
    from kubetron.data.finetuning import build, data_line, settings_of
    from kubetron.data.tokenizer import build_tokenizer

    ft = cfg.finetuning
    if not ft.data_path:
        raise ConfigError("finetuning.data_path", "inspect-data shows fine-tuning data: set finetuning.data_path")
    tokenizer = build_tokenizer(cfg.tokenizer)
    seq_length = cfg.model.seq_length
    built = build(ft.data_path, tokenizer, settings_of(cfg), "finetuning.data_path")
    real = int(built.arrays["offsets"][-1]) - (len(built.arrays["offsets"]) - 1)
    sequences = len(built.arrays["group_offsets"]) - 1
    line = data_line(ft.data_path, built.counts, sequences, seq_length, ft.packing, real)
    print(line, file=err if as_json else out)
    for ex in examples(built):
        if ex["example"] > limit:
            break
        if as_json:
            out.write(json.dumps(ex) + "\n")
            continue
        trained = sum(ex["loss_mask"])
        out.write(f"\n--- example {ex['example']} ({ex['row']}; sequence {ex['sequence']} of {sequences}; "
                  f"{len(ex['ids'])} tokens, {trained} trained)\n")
        out.write(marked_text(tokenizer, ex["ids"], ex["loss_mask"]) + "\n")
    out.flush()
    return 0
