"""The kubetron operator: TrainingJob -> gang of trainer pods, restarted from the last checkpoint.

Pure parts: `model` (the spec), `build` (manifests), `decide` and `policy/` (what to do, and when to look
again). What trainers report (progress log, status endpoint, termination messages, their merge):
`trainer_reports/`. The kopf layer: `handlers` (glue only) over `gather` (what a wake-up reads), `apply`
(carrying out an action), `view`, `events`, `deps`; `compat_kopf` holds every use of kopf's internals; `main`
sets it all up. Everything it calls on the API server is declared in `api_calls`.
"""
