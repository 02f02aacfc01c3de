"""The pod's supervisor: what runs around the training ranks inside a pod.

The pod's entry point and its torchrun (`launch`, `torchrun`: in-place restarts, the root cause of an end, the
exit code), the hang watchdog in torchrun's agent (`watchdog`) and each rank's side of it (`heartbeat`), the
process's start time (`startup`), and the trainer's writes of the contract: the progress log's lines and summary
(`progress_io`) and the termination message (`termination_log`). It imports the contract, compat and storage
only; the training packages above it are handed what they use from here.
"""
