"""What `torchrun` runs in tests/test_multirank.py: `kubetron` plus per-rank bookkeeping.

- `KUBETRON_TEST_RANK_DIR`: each rank writes `pid-<rank>` at start, its termination message to
  `termination-<rank>.log` (torchrun gives all ranks one environment, so the shared
  KUBETRON_TERMINATION_LOG would be overwritten) and its exit code to `exit-<rank>` at the end.
- `KUBETRON_TEST_SLOW_RANK=<rank>` (+ `KUBETRON_TEST_SLOW_SECONDS`): that rank's forward step
  sleeps first, to make it a straggler. The hook lives here, not in the trainer.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _slow_forward_step(delay: float):
    from kubetron.compat import megatron_core

    megatron_core.install()  # as `kubetron train` does, before the trainer imports megatron-core
    from kubetron.training import gpt_step

    original = gpt_step.forward_step

    def forward_step(state: gpt_step.GlobalState, data_iterator, model, return_schedule_plan: bool = False):
        time.sleep(delay)
        return original(state, data_iterator, model, return_schedule_plan)

    gpt_step.forward_step = forward_step


def main() -> int:
    rank = os.environ.get("RANK", "0")
    rank_dir = os.environ.get("KUBETRON_TEST_RANK_DIR")
    if rank_dir:
        d = Path(rank_dir)
        d.mkdir(parents=True, exist_ok=True)
        os.environ["KUBETRON_TERMINATION_LOG"] = str(d / f"termination-{rank}.log")
        (d / f"pid-{rank}").write_text(str(os.getpid()))
    if os.environ.get("KUBETRON_TEST_SLOW_RANK") == rank:
        _slow_forward_step(float(os.environ.get("KUBETRON_TEST_SLOW_SECONDS", "0.05")))
    from kubetron.cli import main as kubetron_main

    code = 1
    try:
        code = kubetron_main(sys.argv[1:])
    finally:
        if rank_dir:
            (Path(rank_dir) / f"exit-{rank}").write_text(str(code))
    return code


if __name__ == "__main__":
    raise SystemExit(main())
