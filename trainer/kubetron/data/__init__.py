"""Data for the trainer: tokenizers, preprocessing, datasets and the micro-batch iterators.

Importing this package is cheap (no torch, no megatron-core); the heavy modules load on first use:

* :mod:`kubetron.data.tokenizer` - ``build_tokenizer(cfg.tokenizer)``, ``tokenizer_assets``, ``tokenizer_from_assets``
* :mod:`kubetron.data.preprocess` - ``preprocess(inputs, output_prefix, tokenizer=...)`` -> ``.bin/.idx``
* :mod:`kubetron.data.datasets` - mock data, and megatron-core's GPT/blended datasets
* :mod:`kubetron.data.loader` - ``build_data_iterators(cfg, dp_rank, dp_size, ...)``, ``DataIterator``
"""

from kubetron.data.tokenizer import (
    ByteTokenizer,
    NullTokenizer,
    build_tokenizer,
    tokenizer_assets,
    tokenizer_from_assets,
)

_LAZY = {
    "preprocess": "kubetron.data.preprocess",
    "MockGPTDataset": "kubetron.data.datasets",
    "EndlessDataset": "kubetron.data.datasets",
    "build_gpt_datasets": "kubetron.data.datasets",
    "DataIterator": "kubetron.data.loader",
    "build_data_iterators": "kubetron.data.loader",
    "build_train_valid_test_data_iterators": "kubetron.data.loader",
    "build_datasets": "kubetron.data.loader",
}

__all__ = [
    "ByteTokenizer",
    "DataIterator",
    "EndlessDataset",
    "MockGPTDataset",
    "NullTokenizer",
    "build_data_iterators",
    "build_datasets",
    "build_gpt_datasets",
    "build_train_valid_test_data_iterators",
    "build_tokenizer",
    "preprocess",
    "tokenizer_assets",
    "tokenizer_from_assets",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kubetron.data' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
