"""Checkpoints: where they are written, and how, in layers (each imports only those above it in this list).

* layout.py - the on-store layout: names (iter_NNNNNNN, the tracker, the commit marker, non_persistent/,
  tokenizer/), the checkpoint version, the architecture fields, which checkpoint to load (resolve_checkpoint)
  and the one way to read a file back (safe_load: weights_only, never a full pickle);
* comm.py - the small collectives a save and the exit schedule need (on the group's device);
* hostcopy.py - the host buffers a snapshot is copied into, and the copy (the C extension _hostcopy.c);
* canonical.py - canonical tensors (the TP=1/PP=1 state dict): gather from this rank's shards, scatter back;
  optimizer state by parameter name;
* one module per format: format_sharded.py (ckpt_format sharded), format_kubetron.py (kubetron),
  format_torch_dist.py (torch_dist, megatron-core's);
* snapshot.py, gang.py - non-persistent "local" checkpoints: snapshots in the pods' memory, their writing, and the
  gang's agreement on one to load (docs/recovery.md; their files: kubetron.storage.snapshot_files);
* rng.py - the random generators' states;
* adapters.py - LoRA's adapter-only checkpoints: which tensors are adapters, which a checkpoint fills;
* progress_log.py - the progress log beside the checkpoints, as this run writes it;
* manager.py - CheckpointManager: what the loop calls to save and restore a run.

Below them all is kubetron.storage (a directory or s3://, transactions that commit with the marker). Nothing
here imports kubetron.hf or kubetron.training (tests/code_graph.py's TRAINER_ORDER): the manager is handed
what it needs of them (`load_hf`, an HF directory's weights). Hugging Face import/export (kubetron.hf.io) uses
layout, canonical and the formats' readers, never the manager.
"""
