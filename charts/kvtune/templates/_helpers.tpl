{{- define "kvtune.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvtune.selectorLabels" -}}
app.kubernetes.io/name: kvtune-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvtune.labels" -}}
{{ include "kvtune.selectorLabels" . }}
app.kubernetes.io/part-of: kvtune
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "kvtune.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvtune.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* The namespaces the operator watches, as JSON: [] means all of them (rbac.clusterWide, the only
       way to get a ClusterRole); otherwise watchNamespaces, or the release's own namespace when that
       is empty. */ -}}
{{- define "kvtune.watchNamespaces" -}}
{{- if .Values.rbac.clusterWide -}}
{{- if .Values.watchNamespaces -}}
{{- fail "rbac.clusterWide: true watches every namespace: leave watchNamespaces empty (or set rbac.clusterWide: false)" -}}
{{- end -}}
[]
{{- else -}}
{{- toJson (.Values.watchNamespaces | default (list .Release.Namespace)) -}}
{{- end -}}
{{- end -}}
