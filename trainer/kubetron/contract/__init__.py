"""The trainer <-> operator contract (docs/CONTRACT.md), the one part of `kubetron` both halves import.

Torch-free and I/O-free: standard library (and pydantic and PyYAML for the config schema) only. The operator image
imports `kubetron.contract` and nothing else of the trainer; the trainer imports nothing of the operator.
"""
