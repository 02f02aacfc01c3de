{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "kubetron.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: the release name, plus the chart name unless the release name already contains it. */}}
{{- define "kubetron.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kubetron.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubetron.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kubetron.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kubetron.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubetron
{{- end }}

{{- define "kubetron.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kubetron.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kubetron.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* kopf peering (one active operator among several): operator.peering, else leader election under the
full name whenever replicas > 1; empty: standalone. */}}
{{- define "kubetron.peering" -}}
{{- if .Values.operator.peering }}
{{- .Values.operator.peering }}
{{- else if gt (int .Values.replicas) 1 }}
{{- include "kubetron.fullname" . }}
{{- end }}
{{- end }}
