"""The kubetron operator: TrainingJob -> gang of trainer pods, restarted from the last checkpoint.

Pure parts: `model` (the spec), `build` (manifests), `decide` (policy). The kopf layer: `handlers`,
`main`. Everything it calls on the API server is declared in `api_calls`.
"""
