{{- define "pdrollout.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdrollout.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "pdrollout.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "pdrollout.labels" -}}
app.kubernetes.io/name: {{ include "pdrollout.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "pdrollout.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdrollout.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}


{{- /* The namespaces the operator watches, as JSON: none (all) when cluster-wide, else watchNamespaces
or the release's own. */ -}}
{{- define "pdrollout.watchNamespaces" -}}
{{- if .Values.rbac.clusterWide -}}
{{- list | toJson -}}
{{- else -}}
{{- .Values.watchNamespaces | default (list .Release.Namespace) | toJson -}}
{{- end -}}
{{- end -}}

{{- /* Labels of the monitoring objects: `release` (what kube-prometheus-stack's default selectors match;
monitoring.releaseLabel, else this release's name) and the object's own `labels`. */ -}}
{{- define "pdrollout.monitoringLabels" -}}
release: {{ .root.Values.monitoring.releaseLabel | default .root.Release.Name | quote }}
{{- with .labels }}
{{ toYaml . }}
{{- end }}
{{- end -}}
