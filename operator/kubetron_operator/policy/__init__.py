"""The operator's policy, one file per concern (as JobSet keeps one per policy); decide.py dispatches to them.

    action.py       Action and Event: what decide() asks the kopf layer to do
    status.py       the status patch: phase and conditions, progress fields, restart counters
    start.py        starting an attempt: creating it, waiting for its gang, start-up trouble and timeout
    attempt_end.py  how an attempt ended: completed, config error, failures, preemptions, rejections
    restart.py      restarting after an attempt ended: counters, backoff, backoffLimit, NoProgress
    elastic.py      elastic node ranges: attempt size, probes, shrink and grow (docs/elastic.md)
    lifecycle.py    finished jobs (TTL), suspension, the active deadline, failing a job
    kueue.py        Kueue plain pod groups: which jobs are queued, releasing the groups whose attempt is over
    store.py        the StoreReadable condition: whether the S3 progress log could be read, and why not
    hang.py         hangs: counting them (restarts.hangs), naming the rank, its pod and node (lastHang, Hung)
    nodes.py        nodes that keep failing a job: failingNodes, avoidNodes
    goodput.py      the goodput ledger: every rank-second since the job was created, by bucket
    create_retry.py children that could not be created: which errors are retried, the backoff, what it waits for
    deadlines.py    every moment decide() compares with the clock (backoffs, deadlines, TTL), defined once
    wake.py         when a job's daemon looks again with nothing but time passing: the soonest of deadlines.py's
    reads.py        when the store's progress log (or an endpoint that failed) is read again
    throttle.py     status patches that only move live progress: at most one every two intervals

The newest checkpoint and iteration any source reports (status, the progress log, rank 0's endpoint, the
termination messages) are merged in kubetron_operator.trainer_reports.merge.

The kopf layer (handlers.py, apply.py, gather.py) calls decide() and the last four. Every function here is
pure: what it needs comes in through kubetron_operator.observe.Observed or as arguments (the clock too, and
the jitter), what it must remember goes into the status patch.
"""


