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
