"""Process exit codes: the trainer's half of the trainer <-> operator contract (docs/CONTRACT.md).

The operator classifies the end of an attempt by these codes, so they never change meaning.
"""

COMPLETED = 0
"""train_iters / train_samples reached; the final checkpoint (if saving) is durable."""

ERROR = 1
"""Unexpected trainer error (a traceback is printed). Counts toward backoffLimit."""

CONFIG_ERROR = 2
"""Bad config or command line: one line naming the field. Retrying cannot help: fail the job."""

DIVERGED = 3
"""NaN/Inf loss or gradient, or a spiky loss with stop enabled: a trainer error that counts toward backoffLimit."""

RESUME_MISMATCH = 4
"""The store holds less than the operator expected (checkpoint.expected_resume_iteration)."""

PEER_FAILURE = 5
"""Another rank died or timed out (collective timeout): the gang must be restarted."""

STRAGGLER = 6
"""Stopped because a straggler was detected and straggler.stop_if_detected is set."""

HUNG = 7
"""A pod's end, never a rank's: its gang hung (no rank made progress past the hang timeout, docs/recovery.md) and
no in-place restart was left; the pod's agent stopped the ranks. A failure: counts toward backoffLimit."""

SAVED_ON_SIGNAL = 75
"""SIGTERM/SIGINT received: finished the step, saved a checkpoint, exited. Preempted: restart, free."""

EXIT_CONDITION = 76
"""exit_interval or exit_duration_in_mins reached; a checkpoint was saved. Restart to continue."""

NAMES = {
    COMPLETED: "Completed",
    ERROR: "TrainerError",
    CONFIG_ERROR: "ConfigError",
    DIVERGED: "Diverged",
    RESUME_MISMATCH: "ResumeMismatch",
    PEER_FAILURE: "PeerFailure",
    STRAGGLER: "StragglerDetected",
    HUNG: "Hung",
    SAVED_ON_SIGNAL: "SavedOnSignal",
    EXIT_CONDITION: "ExitCondition",
}


def reason(code: int) -> str:
    """The name of an exit code (the termination message's and the progress log's `reason`); a code
    outside the contract (a crash, a kill by signal) is a trainer error."""
    return NAMES.get(code, NAMES[ERROR])


NOT_RESTARTED_IN_PLACE = frozenset({COMPLETED, ERROR, CONFIG_ERROR, DIVERGED, RESUME_MISMATCH, HUNG, SAVED_ON_SIGNAL,
                                    EXIT_CONDITION})
"""Ends that a restart inside the same pods would not cure, or that the operator must see (docs/recovery.md)."""


def restartable_in_place(exitcode: int, signal_name: str | None = None) -> bool:
    """Whether a rank's end calls for restarting the gang inside its pods (docs/recovery.md): a peer
    failure or collective timeout (5), a straggler exit (6), a crash with a code that is not the
    contract's, or a kill by a signal other than SIGTERM/SIGINT (a preemption the trainer did not see
    through). `exitcode` is the process's, negative for a signal (as torchrun reports it)."""
    if exitcode < 0:
        return signal_name not in ("SIGTERM", "SIGINT")
    return exitcode not in NOT_RESTARTED_IN_PLACE
