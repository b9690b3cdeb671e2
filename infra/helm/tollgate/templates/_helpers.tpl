{{/* Names and labels. */}}
{{- define "tollgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tollgate.fullname" -}}
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

{{/* The labels of every object; call with (dict "root" $ "component" "gateway"). */}}
{{- define "tollgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
{{ include "tollgate.selectorLabels" . }}
{{- end -}}

{{- define "tollgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tollgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tollgate.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* The Secret every process reads its credentials from. */}}
{{- define "tollgate.secretName" -}}
{{- default (include "tollgate.fullname" .) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "tollgate.backendService" -}}
{{- printf "%s-backend" (include "tollgate.fullname" .) -}}
{{- end -}}

{{/* Gateways find every backend pod through the headless Service's DNS name. */}}
{{- define "tollgate.backendsUrl" -}}
{{- printf "dns://%s.%s.svc:%d" (include "tollgate.backendService" .) .Release.Namespace (int .Values.backend.port) -}}
{{- end -}}

{{/* Seconds Kubernetes gives a terminating pod: preStop, the drain, the settling after
it (gateway/cli/drain.py SETTLE_S, 5 s), a margin. */}}
{{- define "tollgate.gracePeriod" -}}
{{- add (int .Values.config.preStopSeconds) (int .Values.config.drainSeconds) 10 -}}
{{- end -}}

{{/* Keep serving while endpoints catch up, then SIGTERM starts the drain. */}}
{{- define "tollgate.lifecycle" -}}
{{- if .Values.config.preStopSeconds }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ .Values.config.preStopSeconds }}
{{- end }}
{{- end -}}

{{- define "tollgate.podSecurityContext" -}}
{{- toYaml .Values.podSecurityContext -}}
{{- end -}}

{{- define "tollgate.securityContext" -}}
{{- toYaml .Values.securityContext -}}
{{- end -}}

{{/* A credential from the Secret: (dict "root" $ "name" "TOLLGATE_X" "key" "x"). */}}
{{- define "tollgate.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ include "tollgate.secretName" .root }}
      key: {{ .key }}
      {{- if .optional }}
      optional: true
      {{- end }}
{{- end -}}

{{/* The S3 file store's credentials (config.s3), for gateways and workers: optional keys,
empty when the pods' cloud identity signs instead. */}}
{{- define "tollgate.s3Env" -}}
{{ include "tollgate.secretEnv" (dict "root" . "name" "TOLLGATE_S3_ACCESS_KEY_ID" "key" "s3-access-key-id" "optional" true) }}
{{ include "tollgate.secretEnv" (dict "root" . "name" "TOLLGATE_S3_SECRET_ACCESS_KEY" "key" "s3-secret-access-key" "optional" true) }}
{{- end -}}

{{/* What the gateway, worker, beat and migration containers share. */}}
{{- define "tollgate.databaseEnv" -}}
{{ include "tollgate.secretEnv" (dict "root" . "name" "TOLLGATE_DATABASE_URL" "key" "database-url") }}
{{ include "tollgate.secretEnv" (dict "root" . "name" "TOLLGATE_REDIS_URL" "key" "redis-url") }}
{{- end -}}

{{/* Writable scratch space: the root filesystem is read-only. */}}
{{- define "tollgate.scratchVolumes" -}}
- name: tmp
  emptyDir: {}
- name: data
  emptyDir: {}
{{- end -}}

{{- define "tollgate.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: data
  mountPath: /var/lib/tollgate
{{- end -}}

{{/* Gateway, worker and beat wait until the schema exists (on a first install with the
bundled PostgreSQL the migration Job runs after the release's pods are created). */}}
{{- define "tollgate.waitForSchema" -}}
- name: wait-for-schema
  image: {{ include "tollgate.image" (dict "root" . "image" .Values.gateway.image) }}
  imagePullPolicy: {{ .Values.gateway.image.pullPolicy }}
  command:
    - python
    - -c
    - |
      import os, time
      from tenants import db
      url = os.environ["TOLLGATE_DATABASE_URL"]
      for _ in range(300):
          try:
              if db.current_revision(url) is not None:
                  break
          except Exception as exc:
              print("database not ready:", type(exc).__name__, flush=True)
          time.sleep(2)
      else:
          raise SystemExit("no schema after 10 minutes: did the migration Job run?")
  env:
    {{- include "tollgate.secretEnv" (dict "root" . "name" "TOLLGATE_DATABASE_URL" "key" "database-url") | nindent 4 }}
  resources:
    requests: {cpu: 10m, memory: 128Mi}
    limits: {memory: 256Mi}
  securityContext:
    {{- include "tollgate.securityContext" . | nindent 4 }}
  volumeMounts:
    {{- include "tollgate.scratchMounts" . | nindent 4 }}
{{- end -}}
