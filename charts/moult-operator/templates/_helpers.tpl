{{- define "moult-operator.fullname" -}}
{{- printf "%s-moult-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "moult-operator.labels" -}}
app.kubernetes.io/name: moult-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "moult-operator.selector" -}}
app.kubernetes.io/name: moult-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
