"""Hugging Face checkpoints in and out, for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3) and its mixtures
of experts (Qwen3-MoE, Mixtral).

* :mod:`kubetron.hf.config_map` - an HF ``config.json`` <-> kubetron's ``model:`` section;
* :mod:`kubetron.hf.convert` - HF tensor names and layouts <-> kubetron's canonical tensors
  (the TP=1/PP=1 megatron-core state dict that every checkpoint holds, see kubetron/checkpoint/canonical.py);
* :mod:`kubetron.hf.io` - read an HF directory (``*.safetensors``), write a kubetron checkpoint
  (``kubetron import-hf``), write an HF directory from a kubetron checkpoint (``kubetron export-hf``).
* :mod:`kubetron.hf.generation` - the base's special token ids and generation_config.json, carried from
  import through training to export;
* :mod:`kubetron.hf.lora` - a LoRA checkpoint out as merged weights or a PEFT adapter.

Only `safetensors` and torch are needed; `transformers` is never imported here.
"""

from kubetron.hf.config_map import SUPPORTED_ARCHITECTURES, is_hf_dir

__all__ = ["SUPPORTED_ARCHITECTURES", "is_hf_dir"]
