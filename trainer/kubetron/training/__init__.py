"""The training half: model, loop, checkpoints (imports torch and megatron-core).

Importing it changes no library: the run's setup calls `kubetron.compat.megatron_core.install()` first, so
megatron-core is imported with its import-time costs deferred (kubetron/compat).
"""
