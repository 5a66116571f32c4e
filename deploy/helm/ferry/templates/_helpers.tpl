{{/* Names and labels. */}}
{{- define "ferry.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ferry.fullname" -}}
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

{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ferry.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ferry.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ferry.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: {{ .Values.mode }}
{{- end -}}

{{- define "ferry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ferry.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ferry.secretName" -}}
{{- default (printf "%s-peer-key" (include "ferry.fullname" .)) .Values.secret.existingSecret -}}
{{- end -}}

{{- define "ferry.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Where the container finds its files. */}}
{{/* The headless Service's DNS name, fully qualified (the final dot skips the search list). */}}
{{- define "ferry.serviceDnsName" -}}
{{- printf "%s.%s.svc.%s." (include "ferry.fullname" .) .Release.Namespace .Values.discovery.clusterDomain -}}
{{- end -}}

{{- define "ferry.configDir" -}}/etc/ferry{{- end -}}
{{- define "ferry.configFile" -}}{{ include "ferry.configDir" . }}/ferry.yaml{{- end -}}
{{- define "ferry.secretDir" -}}/etc/ferry/secret{{- end -}}
{{- define "ferry.secretFile" -}}{{ include "ferry.secretDir" . }}/peer-key{{- end -}}

{{/*
ferry's configuration: .Values.config with the keys the chart owns set by the chart.
A key the chart owns that .Values.config sets too is refused, naming it.
*/}}
{{- define "ferry.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) -}}
{{- $node := get $cfg "node" | default dict -}}
{{- range $key := list "name" "listen" "socket_dir" "danger_listen_any" -}}
{{- if hasKey $node $key -}}
{{- fail (printf "config.node.%s is set by the chart (see values.yaml, config); remove it" $key) -}}
{{- end -}}
{{- end -}}
{{- if hasKey $cfg "security" -}}
{{- fail "config.security is set by the chart from `secret`; remove it" -}}
{{- end -}}
{{- $telemetry := get $cfg "telemetry" | default dict -}}
{{- if hasKey $telemetry "metrics_listen" -}}
{{- fail "config.telemetry.metrics_listen is set by the chart from ports.metrics; remove it" -}}
{{- end -}}
{{- if .Values.discovery.enabled -}}
{{- if not .Values.service.enabled -}}
{{- fail "discovery.enabled needs service.enabled: the nodes find each other through the headless Service's DNS records" -}}
{{- end -}}
{{- $discovery := get $cfg "discovery" | default dict -}}
{{- range $key := list "mode" "dns" "interval" -}}
{{- if hasKey $discovery $key -}}
{{- fail (printf "config.discovery.%s is set by the chart from `discovery` (values.yaml); remove it, or set discovery.enabled: false" $key) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $discovery "mode" "dns" -}}
{{- $_ := set $discovery "dns" (list (dict "name" (include "ferry.serviceDnsName" .) "port" (int .Values.ports.ferry))) -}}
{{- $_ := set $discovery "interval" .Values.discovery.interval -}}
{{- $_ := set $cfg "discovery" $discovery -}}
{{- end -}}
{{- $_ := set $node "socket_dir" .Values.socketDir.path -}}
{{- $_ := set $cfg "node" $node -}}
{{- $_ := set $cfg "security" (dict "secret_file" (include "ferry.secretFile" .)) -}}
{{- $_ := set $telemetry "metrics_listen" (printf "0.0.0.0:%d" (int .Values.ports.metrics)) -}}
{{- $_ := set $cfg "telemetry" $telemetry -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Refusals that values.schema.json cannot express. */}}
{{- define "ferry.checks" -}}
{{- if hasKey (.Values.podSecurityContext | default dict) "fsGroup" -}}
{{- fail "podSecurityContext.fsGroup adds group read to the peer key file, which ferry refuses; remove it" -}}
{{- end -}}
{{- if and (eq .Values.mode "sidecar") (not .Values.sidecar.app.image) -}}
{{- fail "sidecar mode needs sidecar.app.image: the application that runs beside ferry" -}}
{{- end -}}
{{- end -}}

{{/* The ferry container: the same in both modes, but for the GPU environment. */}}
{{- define "ferry.container" -}}
- name: ferry
  image: {{ include "ferry.image" . }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["/usr/local/bin/ferry"]
  args: ["serve", "--config", {{ include "ferry.configFile" . | quote }}]
  env:
    - name: POD_IP
      valueFrom:
        fieldRef:
          fieldPath: status.podIP
    - name: FERRY__NODE__NAME
      valueFrom:
        fieldRef:
          fieldPath: {{ if eq .Values.mode "daemonset" }}spec.nodeName{{ else }}metadata.name{{ end }}
    - name: FERRY__NODE__LISTEN
      value: {{ printf "[\"$(POD_IP):%d\"]" (int .Values.ports.ferry) | quote }}
    {{- if .Values.hostIdFromNodeName }}
    - name: FERRY__NODE__HOST_ID
      valueFrom:
        fieldRef:
          fieldPath: spec.nodeName
    {{- end }}
    {{- if eq .Values.mode "daemonset" }}
    - name: NVIDIA_VISIBLE_DEVICES
      value: {{ .Values.gpu.visibleDevices | quote }}
    - name: NVIDIA_DRIVER_CAPABILITIES
      value: {{ .Values.gpu.driverCapabilities | quote }}
    {{- else }}
    # The pod's GPUs belong to the application container (values.yaml, sidecar.app).
    - name: NVIDIA_VISIBLE_DEVICES
      value: void
    {{- end }}
    {{- with .Values.extraEnv }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: ferry
      containerPort: {{ .Values.ports.ferry }}
      protocol: TCP
    - name: metrics
      containerPort: {{ .Values.ports.metrics }}
      protocol: TCP
  livenessProbe:
    httpGet:
      path: {{ .Values.probes.liveness.path }}
      port: metrics
    initialDelaySeconds: {{ .Values.probes.liveness.initialDelaySeconds }}
    periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
    timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
    failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
  readinessProbe:
    httpGet:
      path: {{ .Values.probes.readiness.path }}
      port: metrics
    initialDelaySeconds: {{ .Values.probes.readiness.initialDelaySeconds }}
    periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
    timeoutSeconds: {{ .Values.probes.readiness.timeoutSeconds }}
    failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
  {{- $resources := deepCopy (.Values.resources | default dict) }}
  {{- if .Values.rdma.enabled }}
  {{- /* Extended resources: requests must equal limits. */}}
  {{- $requests := get $resources "requests" | default dict }}
  {{- $limits := get $resources "limits" | default dict }}
  {{- range $name, $count := .Values.rdma.resources }}
  {{- $_ := set $requests $name $count }}
  {{- $_ := set $limits $name $count }}
  {{- end }}
  {{- $_ := set $resources "requests" $requests }}
  {{- $_ := set $resources "limits" $limits }}
  {{- end }}
  resources:
    {{- toYaml $resources | nindent 4 }}
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  volumeMounts:
    - name: config
      mountPath: {{ include "ferry.configDir" . }}/ferry.yaml
      subPath: ferry.yaml
      readOnly: true
    - name: peer-key
      mountPath: {{ include "ferry.secretDir" . }}
      readOnly: true
    - name: sockets
      mountPath: {{ .Values.socketDir.path }}
    - name: shm
      mountPath: /dev/shm
    - name: tmp
      mountPath: /tmp
{{- end -}}

{{/* Pod-level settings and volumes shared by both modes. */}}
{{- define "ferry.podSettings" -}}
serviceAccountName: {{ include "ferry.serviceAccountName" . }}
automountServiceAccountToken: false
{{- with .Values.gpu.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- if .Values.hostNetwork }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- if .Values.hostIPC }}
hostIPC: true
{{- end }}
terminationGracePeriodSeconds: {{ .Values.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.gpu.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.gpu.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: config
    configMap:
      name: {{ include "ferry.fullname" . }}
  - name: peer-key
    secret:
      secretName: {{ include "ferry.secretName" . }}
      defaultMode: {{ .Values.secret.defaultMode }}
      items:
        - key: {{ .Values.secret.key }}
          path: peer-key
  - name: sockets
    {{- if and (eq .Values.mode "daemonset") .Values.socketDir.hostPath }}
    hostPath:
      path: {{ .Values.socketDir.hostPath }}
      type: DirectoryOrCreate
    {{- else }}
    emptyDir: {}
    {{- end }}
  - name: shm
    emptyDir:
      medium: Memory
      {{- with .Values.shm.sizeLimit }}
      sizeLimit: {{ . }}
      {{- end }}
  - name: tmp
    emptyDir: {}
{{- end -}}

{{- define "ferry.podMetadata" -}}
labels:
  {{- include "ferry.selectorLabels" . | nindent 2 }}
  {{- with .Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  checksum/config: {{ include "ferry.config" . | sha256sum }}
  {{- with .Values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end -}}
