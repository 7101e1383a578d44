{{/* names and labels */}}
{{- define "agentstream.name" -}}{{ printf "%s-%s" .Release.Name .component | trunc 63 | trimSuffix "-" }}{{- end }}

{{- define "agentstream.labels" -}}
app.kubernetes.io/name: agentstream-{{ .component }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: agentstream
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "agentstream.selector" -}}
app.kubernetes.io/name: agentstream-{{ .component }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "agentstream.secret" -}}{{ .Values.auth.existingSecret | default (printf "%s-auth" .Release.Name) }}{{- end }}

{{/* a variable from a key of the auth Secret; `optional` for the keys an existingSecret may lack */}}
{{- define "agentstream.secretEnv" -}}
- name: {{ .name }}
  valueFrom: {secretKeyRef: {name: {{ include "agentstream.secret" .root }}, key: {{ .key }}{{ if .optional }}, optional: true{{ end }}}}
{{- end }}

{{- define "agentstream.image" -}}{{ .Values.image.repository }}:{{ index .Values.image .image }}{{- end }}

{{/* the gateway as attempt pods reach it: its Service's name, port and fixed ClusterIP */}}
{{- define "agentstream.gatewayHost" -}}{{ printf "%s-gateway.%s.svc" .Release.Name .Release.Namespace }}{{- end }}
{{- define "agentstream.gatewayURL" -}}http://{{ include "agentstream.gatewayHost" . }}:{{ .Values.gateway.port }}{{- end }}
{{- define "agentstream.gatewayIP" -}}
{{- $service := lookup "v1" "Service" .Release.Namespace (printf "%s-gateway" .Release.Name) -}}
{{- if .Values.gateway.service.clusterIP -}}{{ .Values.gateway.service.clusterIP }}
{{- else if $service -}}{{ $service.spec.clusterIP }}
{{- end -}}
{{- end }}

{{/* every pod passes the `restricted` Pod Security Standard: non-root, no capabilities, read-only root */}}
{{- define "agentstream.podSecurity" -}}
enableServiceLinks: false
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile: {type: RuntimeDefault}
{{- with .Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "agentstream.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities: {drop: [ALL]}
{{- end }}

{{/* Kafka for every service, then the service's own variables */}}
{{- define "agentstream.kafkaEnv" -}}
- {name: KAFKA_BOOTSTRAP_SERVERS, value: {{ .Values.kafka.bootstrapServers | quote }}}
- {name: AGENTSTREAM_TOPIC_PREFIX, value: {{ .Values.kafka.topicPrefix | quote }}}
- {name: AGENTSTREAM_PARTITIONS, value: {{ .Values.kafka.partitions | quote }}}
- {name: AGENTSTREAM_REPLICATION_FACTOR, value: {{ .Values.kafka.replicationFactor | quote }}}
{{- with .Values.kafka.sasl }}{{ if .enabled }}
{{- if not (and .username .passwordSecret.name) }}
{{- fail "kafka.sasl.enabled needs kafka.sasl.username and kafka.sasl.passwordSecret.name (a Secret holding the user's password)" }}
{{- end }}
- {name: AGENTSTREAM_SECURITY_PROTOCOL, value: {{ ternary "SASL_SSL" "SASL_PLAINTEXT" $.Values.kafka.tls }}}
- {name: AGENTSTREAM_SASL_MECHANISM, value: {{ .mechanism | quote }}}
- {name: AGENTSTREAM_SASL_USERNAME, value: {{ .username | quote }}}
- name: AGENTSTREAM_SASL_PASSWORD
  valueFrom: {secretKeyRef: {name: {{ .passwordSecret.name }}, key: {{ .passwordSecret.key | default "password" }}}}
{{- else if $.Values.kafka.tls }}
- {name: AGENTSTREAM_SECURITY_PROTOCOL, value: SSL}
{{- end }}{{ end }}
{{- range $name, $value := .Values.kafka.env }}
- {name: {{ $name }}, value: {{ $value | quote }}}
{{- end }}
{{- end }}

{{/* a service's settings by field name (`trainer.settings.lr: 1e-4`), as the variables its settings model reads
(AGENTSTREAM_LR); lists and maps as JSON. Any field of `python -m agentstream.<service> --help` */}}
{{- define "agentstream.settings" -}}
{{- range $name, $value := . }}
- {name: {{ printf "AGENTSTREAM_%s" (upper $name) }}, value: {{ if or (kindIs "slice" $value) (kindIs "map" $value) }}{{ toJson $value | quote }}{{ else }}{{ toString $value | quote }}{{ end }}}
{{- end }}
{{- end }}

{{- define "agentstream.extraEnv" -}}
{{- range $name, $value := . }}
- {name: {{ $name }}, value: {{ $value | quote }}}
{{- end }}
{{- end }}

{{/* a writable /tmp and home under the read-only root */}}
{{- define "agentstream.scratchMounts" -}}
- {name: tmp, mountPath: /tmp}
- {name: home, mountPath: /home/agentstream}
{{- end }}
{{- define "agentstream.scratchVolumes" -}}
- {name: tmp, emptyDir: {}}
- {name: home, emptyDir: {}}
{{- end }}

{{/* liveness at `path`; readiness at `ready` where the service has one apart (the gateway's /readyz: an upstream
reload takes the pod out of the Service, it does not restart it) */}}
{{- define "agentstream.httpProbe" -}}
readinessProbe:
  httpGet: {path: {{ .ready | default .path }}, port: http}
  periodSeconds: 10
livenessProbe:
  httpGet: {path: {{ .path }}, port: http}
  periodSeconds: 20
  failureThreshold: 6
{{- end }}
