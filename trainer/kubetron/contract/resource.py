"""The TrainingJob resource as its users and the operator both name it: the API group, version, kind and
plural (crds/trainingjob.yaml), the labels every pod of a job carries, the trainer's container name and the
phases a job never leaves. The operator builds with these names; `kubetron.client` finds jobs and pods by them.
"""

from __future__ import annotations

GROUP = "kubetron.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "TrainingJob"
PLURAL = "trainingjobs"

LABEL_JOB = "kubetron.dev/job"
LABEL_ATTEMPT = "kubetron.dev/attempt"
LABEL_RANK = "kubetron.dev/rank"
LABEL_ROLE = "kubetron.dev/role"  # worker | probe

TRAINER = "trainer"
"""The trainer's container in a worker pod (what `kubectl logs` and `kubetron logs` read)."""

FINISHED = ("Succeeded", "Failed")
"""The phases a job never leaves (a finished job is never rerun)."""
