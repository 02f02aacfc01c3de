"""Hugging Face checkpoints in and out, for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) and its mixtures
of experts (Qwen3-MoE, Mixtral).

* :mod:`kubetron.hf.config_map` - an HF ``config.json`` <-> kubetron's ``model:`` section;
* :mod:`kubetron.hf.convert` - HF tensor names and layouts <-> kubetron's canonical tensors
  (the TP=1/PP=1 megatron-core state dict that every checkpoint holds, see kubetron/checkpoint/canonical.py);
* :mod:`kubetron.hf.safetensors_io` - safetensors files: headers checked before a tensor is read, written
  tensor by tensor;
* :mod:`kubetron.hf.weights` - canonical tensors read one at a time from an HF directory (the files transformers
  reads), a kubetron checkpoint, or a LoRA base with its adapters merged;
* :mod:`kubetron.hf.io` - ``kubetron import-hf`` (an HF directory into a kubetron checkpoint) and
  ``kubetron export-hf`` (a kubetron checkpoint into an HF directory, sharded past ``--max-shard-size``).
* :mod:`kubetron.hf.generation` - the base's special token ids and generation_config.json, carried from
  import through training to export;
* :mod:`kubetron.hf.lora` - a LoRA checkpoint out as merged weights or a PEFT adapter.

Only torch is needed (safetensors is read and written here); `transformers` is never imported.
"""

from kubetron.hf.config_map import SUPPORTED_ARCHITECTURES, is_hf_dir

__all__ = ["SUPPORTED_ARCHITECTURES", "is_hf_dir"]
