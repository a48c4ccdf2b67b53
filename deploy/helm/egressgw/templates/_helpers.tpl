{{/* Names and labels shared by every template. */}}

{{- define "egressgw.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object names: the release name, "egressgw" in it or not. */}}
{{- define "egressgw.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "egressgw.agentName" -}}
{{- printf "%s-agent" (include "egressgw.fullname" .) -}}
{{- end -}}

{{- define "egressgw.controllerName" -}}
{{- printf "%s-controller" (include "egressgw.fullname" .) -}}
{{- end -}}

{{- define "egressgw.configName" -}}
{{- printf "%s-config" (include "egressgw.fullname" .) -}}
{{- end -}}

{{- define "egressgw.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "egressgw.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: egressgw
{{- end -}}

{{/* Selector labels of one component: "agent" or "controller". */}}
{{- define "egressgw.selectorLabels" -}}
app.kubernetes.io/name: {{ include "egressgw.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "egressgw.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The config file the daemons read: the feature block as given. */}}
{{- define "egressgw.config" -}}
# egressgw's config, from the chart's `feature` values.
{{ toYaml .Values.feature }}
{{- end -}}

{{/* Environment both daemons get. */}}
{{- define "egressgw.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: EGRESSGW_CONFIG
  value: /etc/egressgw/config.yaml
- name: RUST_LOG
  value: {{ .Values.log.level | quote }}
- name: EGRESSGW_LOG_FORMAT
  value: {{ .Values.log.format | quote }}
{{- end -}}

{{/* The agent's username as the API server sees it. */}}
{{- define "egressgw.agentUser" -}}
{{- printf "system:serviceaccount:%s:%s" .Release.Namespace (include "egressgw.agentName" .) -}}
{{- end -}}

{{/* The ServiceAccount token, CA and namespace, as Kubernetes mounts them
for a Pod that asks for it (the ServiceAccounts have automounting off, so
only the daemons' containers get it). The token is bound to the Pod. */}}
{{- define "egressgw.apiAccessVolume" -}}
- name: api-access
  projected:
    defaultMode: 0444
    sources:
      - serviceAccountToken:
          path: token
          expirationSeconds: 3607
      - configMap:
          name: kube-root-ca.crt
          items:
            - key: ca.crt
              path: ca.crt
      - downwardAPI:
          items:
            - path: namespace
              fieldRef:
                apiVersion: v1
                fieldPath: metadata.namespace
{{- end -}}
