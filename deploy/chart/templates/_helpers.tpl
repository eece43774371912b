{{/* The labels of every object: those `deploy/` gives, and Helm's own. */}}
{{- define "ebb.labels" -}}
app.kubernetes.io/name: ebb
app.kubernetes.io/part-of: ebb
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The name of the cluster-scoped objects (see values.yaml: clusterName). */}}
{{- define "ebb.clusterName" -}}
{{- if .Values.clusterName -}}
{{ .Values.clusterName }}
{{- else if eq .Release.Namespace "ebb" -}}
ebb
{{- else -}}
ebb-{{ .Release.Namespace }}
{{- end -}}
{{- end -}}

{{/* ebb's ServiceAccount, as an RBAC subject. */}}
{{- define "ebb.subject" -}}
- kind: ServiceAccount
  name: ebb
  namespace: {{ .Release.Namespace }}
{{- end -}}
