"""The kubetron trainer with a frozen padding parameter, for benchmarks of state that grows while steps do not.

    KUBETRON_LAUNCH_MODULE=padded_trainer KUBETRON_BENCH_PADDING_BYTES=N PYTHONPATH=bench:... \\
        python -m kubetron.launch train ...

Each model chunk of every rank gets `padding`, a frozen fp32 parameter of N bytes (zeros; never used by the
forward pass, no gradient, no optimizer state). Checkpoints and memory snapshots carry it like any replicated
weight, split over the ranks (format_sharded: each rank writes about N / world bytes of it), so a rank's share of
the state grows by that much while a step costs what the tiny GPT's does. Widening the model instead
(`model.hidden_size`) makes CPU steps of seconds, and the snapshot interval, the iterations lost and the
recovery times would then measure the step, not the state (bench/recovery.py --memory).
"""

from __future__ import annotations

import os

PADDING_ENV = "KUBETRON_BENCH_PADDING_BYTES"
NAME = "padding"


def install(nbytes: int) -> None:
    """Every model the trainer builds from now on carries a frozen `padding` parameter of `nbytes` bytes."""
    import torch
    from kubetron.training import run

    if nbytes <= 0:
        return
    build = run.build_model

    def padded(cfg, device: torch.device) -> list[torch.nn.Module]:
        chunks = build(cfg, device)
        for chunk in chunks:
            chunk.register_parameter(NAME, torch.nn.Parameter(torch.zeros(nbytes // 4, device=device),
                                                              requires_grad=False))
        return chunks

    run.build_model = padded


def main() -> int:
    from kubetron.cli import main as kubetron_main

    install(int(os.environ.get(PADDING_ENV) or 0))
    return kubetron_main()


if __name__ == "__main__":
    raise SystemExit(main())
