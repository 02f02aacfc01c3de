{{- /*
The operator's Kubernetes API calls as RBAC rules: the registry in
operator/kubetron_operator/api_calls.py (OPERATOR_CALLS: kubetron's own code; KOPF_CALLS: the kopf
framework), with each conditional call granted only when it can happen. tests/test_chart.py derives the
required rules from that registry for every values combination and fails on anything missing or extra.

  podgroups (three API groups) only with gangScheduling.enabled, per scheduler
  namespaces list/watch        only with watchNamespaces: kopf observes namespaces only when it is
                               not cluster-wide
  (cluster)kopfpeerings        only with peering (operator.peering, or replicas > 1): standalone kopf
                               never touches them
  nodes get/patch              only with failingNodes.taint: tainting a node that keeps failing jobs
*/ -}}

{{/* Cluster-scoped resources: always in a ClusterRole. */}}
{{- define "kubetron.clusterRules" -}}
# kopf: notices the TrainingJob CRD being installed, changed or removed while it runs.
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
# The nodes under a job's pods: a pod on a node that is not Ready (or gone) ended by preemption.
- apiGroups: [""]
  resources: [nodes]
  verbs: [list]
{{- if .Values.failingNodes.taint }}
# A node that fails jobs (policy/nodes.py): tainted kubetron.dev/failing-node=<namespace>:NoSchedule and annotated
# (read, then patched), the taint removed after failingNodes.taintSeconds.
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, patch]
{{- end }}
{{- if .Values.watchNamespaces }}
# kopf: checks the watched namespaces exist (it serves only those that do).
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- else if include "kubetron.peering" . }}
# kopf: the ClusterKopfPeering object that lets one of several operators be active.
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- end }}

{{/* Namespaced resources: in the ClusterRole (cluster-wide) or a Role per watched namespace. */}}
{{- define "kubetron.namespacedRules" -}}
# The TrainingJobs: kopf watches them and patches its finalizer onto Kueue-queued ones (off others, left by
# an older operator); the operator reads them, deletes finished ones after ttlSecondsAfterFinished, and
# writes their status.
- apiGroups: [kubetron.dev]
  resources: [trainingjobs]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [kubetron.dev]
  resources: [trainingjobs/status]
  verbs: [get, patch]
# Children carry blockOwnerDeletion owner references, which need update on the owner's finalizers.
- apiGroups: [kubetron.dev]
  resources: [trainingjobs/finalizers]
  verbs: [update]
# Each attempt's pods: created, watched (label-selected) for phases/exit codes/termination messages
# (the progress-reader pod's too, so no pods/log or pods/exec), deleted to end it; patched to mark an
# ended attempt's Kueue pod group kueue.x-k8s.io/retriable-in-group=false (Kueue then frees its quota).
- apiGroups: [""]
  resources: [pods]
  verbs: [create, get, list, watch, delete, patch]
# Rank 0's headless rendezvous Service. get: when one exists already, only the job that controls it
# may use or delete it.
- apiGroups: [""]
  resources: [services]
  verbs: [create, get, delete]
# The S3 credentials a job's storage.s3.secretRef names, to read its progress log. create: a job's peer token,
# <job>-peers, which its pods' agents require of each other (docs/recovery.md), once a pod of the job is placed;
# get: whose is an existing one.
- apiGroups: [""]
  resources: [secrets]
  verbs: [create, get]
# An event per status change (the operator's own and kopf's handler events).
- apiGroups: [""]
  resources: [events]
  verbs: [create]
{{- if and (include "kubetron.peering" .) .Values.watchNamespaces }}
# kopf: the KopfPeering object in each watched namespace (several operators, one active).
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch]
{{- end }}
{{- if .Values.gangScheduling.enabled }}
{{- if has "volcano" .Values.gangScheduling.schedulers }}
# Gang scheduling with Volcano: one PodGroup per attempt.
- apiGroups: [scheduling.volcano.sh]
  resources: [podgroups]
  verbs: [create, get, delete]
{{- end }}
{{- if has "coscheduling" .Values.gangScheduling.schedulers }}
# Gang scheduling with scheduler-plugins coscheduling: one PodGroup per attempt.
- apiGroups: [scheduling.x-k8s.io]
  resources: [podgroups]
  verbs: [create, get, delete]
{{- end }}
{{- if has "kubernetes" .Values.gangScheduling.schedulers }}
# Kubernetes' own gang scheduling, whichever version the cluster serves: v1beta1 (1.37+: one PodGroup per job,
# its minCount patched to each attempt's size) or v1alpha2 (1.36: one per attempt). Which one is served is read by
# discovery, which Kubernetes' default system:discovery role grants to every authenticated user.
- apiGroups: [scheduling.k8s.io]
  resources: [podgroups]
  verbs: [create, get, delete, patch]
{{- end }}
{{- end }}
{{- end }}
