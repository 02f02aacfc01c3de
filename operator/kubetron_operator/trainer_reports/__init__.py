"""How the operator learns a job's progress: what the trainer reports, one module per source, and their merge.

    status_endpoint.py  rank 0's live numbers (GET http://<pod-ip>:<statusPort>/status), read every interval
    store_log.py        the tail of the progress log in the job's S3 store, signed with the job's Secret only
    termination.py      the one-line JSON each rank leaves as its container's termination message
    merge.py            the newest checkpoint and the last iteration any of them (or status) reports, pure
    http_get.py         the one bounded GET the two network reads share (deadline, size, no redirects)

Everything a pod or a store serves is hostile input: each read is bounded in time and size, and what it
gives is range-checked (kubetron_operator.untrusted) before decide() sees it.
"""
