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
    SAVED_ON_SIGNAL: "SavedOnSignal",
    EXIT_CONDITION: "ExitCondition",
}
