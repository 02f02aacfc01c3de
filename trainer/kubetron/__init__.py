"""kubetron: a Megatron-Bridge-style trainer on megatron-core, plus a Kubernetes operator that runs it.

Importing this package is cheap (no torch): the operator image imports `kubetron.contract` (and nothing
else of it) without the trainer's dependencies.
"""

__version__ = "0.1.0"
