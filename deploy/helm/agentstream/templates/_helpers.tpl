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

{{- define "agentstream.httpProbe" -}}
readinessProbe:
  httpGet: {path: {{ .path }}, port: http}
  periodSeconds: 10
livenessProbe:
  httpGet: {path: {{ .path }}, port: http}
  periodSeconds: 20
  failureThreshold: 6
{{- end }}
