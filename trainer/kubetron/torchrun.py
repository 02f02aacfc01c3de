"""`python -m kubetron.torchrun ARGS`: torchrun (`torch.distributed.run`, same arguments) as
`kubetron.launch` runs it, quiet about the endings the ranks report themselves.

Plain torchrun ends a failed run with its own report after the ranks' output: a log line per failed
rank, a `ChildFailedError` traceback and a banner (or a `SignalException` traceback when it was
stopped by SIGTERM). In a pod that buries the one line the trainer printed (`kubetron: error: ...`,
`kubetron: SavedOnSignal: ...`) under forty lines that say nothing more. This runs torchrun's own
`run()` and leaves the report to the launcher: the ranks' failures (rank, exit status, signal) go
to a JSON file in the launcher's messages directory, and the launcher says, in one line, what no
rank's termination message explains. Exit status: 0 when the ranks succeeded, 1 when one failed,
128 + N when torchrun itself was stopped by signal N.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence

FAILURES_FILE = "torchrun-failures.json"  # in the launcher's messages directory (KUBETRON_LAUNCH_MESSAGES)


class _NoFailureReport(logging.Filter):
    """Drops torchrun's `failed (exitcode: N) local_rank: ...` line, and its `Sending process N closing
    signal SIGTERM` to the other ranks after one failed (the launcher reports failures)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(("failed (exitcode", "Sending process"))


def failure_records(failures) -> list[dict]:
    """torchrun's {global rank: ProcessFailure} as JSON-able dicts, first failure first."""
    out = []
    for rank, f in sorted(failures.items(), key=lambda item: item[1].timestamp):
        out.append({"rank": rank, "localRank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode,
                    "signal": f.signal_name() if f.exitcode < 0 else None})
    return out


def _write_failures(failures) -> None:
    directory = os.environ.get("KUBETRON_LAUNCH_MESSAGES")
    if not directory:
        return
    try:
        with open(os.path.join(directory, FAILURES_FILE), "w", encoding="utf-8") as fh:
            json.dump(failure_records(failures), fh)
    except OSError:
        pass  # the launcher falls back to torchrun's exit status


def main(argv: Sequence[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoFailureReport())
    args = torchrun.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        _write_failures(exc.failures)
        return 1
    except SignalException as exc:  # torchrun has forwarded it and waited for the ranks
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
