{{/*
The values added since the chart's first version, each with its default in values.yaml
(test_helm.py::test_values_an_older_release_lacks_render_as_a_fresh_install holds them to it).
`helm upgrade --reuse-values` renders these templates with the values of the release being
upgraded, its own chart's defaults included: in a release an older chart made, a value added
since is absent, not this chart's default. Absent, operator.enabled removed the operator's
Deployment, ServiceAccount and RBAC, and sidecar.shutdownGraceSeconds rendered
--shutdown-grace= (opgate exits 2 at start).
*/}}
{{- define "opgate.addedValues" -}}
operator: {enabled: true}
sidecar:
  native: false
  shutdownDelaySeconds: 5
  shutdownGraceSeconds: 10
  tmpSizeLimit: 16Mi
  audit: {enabled: false, path: /var/log/opgate/audit.log, maxSizeMB: 100, maxBackups: 5, sizeLimit: 1Gi}
  capture: {enabled: false, path: /var/log/opgate-capture/capture.flows, maxSizeMB: 100, maxBackups: 5, sizeLimit: 1Gi}
terminationGracePeriodSeconds: 30
{{- end -}}

{{/*
Sets in a context's .Values each of opgate.addedValues it lacks, so that an upgrade of an older
release renders what a fresh install with the same settings would. Only an absent key is set:
one the values hold, null or false included (policies: null, operator.enabled: false), stays.
Each template and opgate.context call it first (helm renders the files in no order of ours).
*/}}
{{- define "opgate.fillAbsent" -}}
{{- include "opgate.fillAbsentIn" (list .Values (fromYaml (include "opgate.addedValues" .))) -}}
{{- end -}}

{{- define "opgate.fillAbsentIn" -}}
{{- $values := index . 0 -}}
{{- range $key, $default := index . 1 -}}
{{- if not (hasKey $values $key) -}}
{{- $_ := set $values $key $default -}}
{{- else if and (kindIs "map" $default) (kindIs "map" (get $values $key)) -}}
{{- include "opgate.fillAbsentIn" (list (get $values $key) $default) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
"true" when a Redis URL holds a password: in its userinfo (redis://:PASSWORD@, USER:PASSWORD@), or
in its query, where redis-py reads ?password= (and a Sentinel's ?sentinel_password=: opgate's
redacted_url hides every *password option there).
*/}}
{{- define "opgate.holdsPassword" -}}
{{- $url := toString (. | default "") -}}
{{- if or (regexMatch "^[A-Za-z+]+://[^/?#@]*:[^/?#@]+@" $url) (regexMatch "(?i)[?&][^=&#]*password=[^&#]" $url) -}}
true
{{- end -}}
{{- end -}}

{{/*
A Kubernetes quantity (1Gi, 512Mi, 2G, 1e9, 1258291200 bytes; 1500m CPUs) in its unit, as a float.
*/}}
{{- define "opgate.quantity" -}}
{{- $q := trimPrefix "+" (toString .) -}}
{{- $num := regexFind "^([0-9]+([.][0-9]*)?|[.][0-9]+)" $q -}}
{{- $units := dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 "n" 0.000000001 "u" 0.000001 "m" 0.001 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0 "E" 1000000000000000000.0 -}}
{{- $unit := trimPrefix $num $q -}}
{{- if hasKey $units $unit -}}
{{- mulf (float64 $num) (get $units $unit) -}}
{{- else -}}
{{- float64 $q -}}
{{- end -}}
{{- end -}}

{{/* Names, as in charts made by helm create (nameOverride, fullnameOverride) */}}
{{- define "opgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "opgate.fullname" -}}
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

{{/*
The full name with a suffix ("metrics", "policies", "kubeconfig"), the full name cut short so
that the whole still fits 63 characters (a Service name is a DNS label).
  {{ include "opgate.suffixedName" (list . "metrics") }}
*/}}
{{- define "opgate.suffixedName" -}}
{{- $ctx := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $base := include "opgate.fullname" $ctx | trunc (int (sub 62 (len $suffix))) | trimSuffix "-" -}}
{{- printf "%s-%s" $base $suffix -}}
{{- end -}}

{{/*
The name of the cluster-scoped objects (the ClusterRole and its binding): <namespace>-<full
name>. The full name alone is the release's, which is unique only in its namespace: the same
release name in a second namespace (one install per team) would collide with the first's
ClusterRole, and helm refuses to take over an object another release owns.
*/}}
{{- define "opgate.clusterName" -}}
{{- printf "%s-%s" .Release.Namespace (include "opgate.fullname" .) -}}
{{- end -}}

{{/*
The operator's ServiceAccount: the one the chart creates (serviceAccount.name, default the full
name), or with serviceAccount.create=false an existing one (serviceAccount.name, default the
namespace's "default", as in charts made by helm create).
*/}}
{{- define "opgate.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "opgate.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "opgate.labels" -}}
app.kubernetes.io/name: {{ include "opgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "opgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "opgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/*
The admin port: the port of sidecar.adminListen (HOST:PORT or [V6]:PORT, for the kubelet's probes
and Prometheus). sidecar.adminPort is deprecated: accepted only when it names the same port.
*/}}
{{- define "opgate.adminPort" -}}
{{- $listen := toString .Values.sidecar.adminListen -}}
{{- if not (regexMatch "^(\\[[0-9A-Fa-f:.]+\\]|[^:/\\[\\]]+):[0-9]{1,5}$" $listen) -}}
{{- fail (printf "sidecar.adminListen must be HOST:PORT or [V6]:PORT (the kubelet's probes and Prometheus need a TCP port), got %q" $listen) -}}
{{- end -}}
{{- $port := regexFind "[0-9]+$" $listen -}}
{{- if or (lt (atoi $port) 1) (gt (atoi $port) 65535) -}}
{{- fail (printf "sidecar.adminListen=%s: the port must be from 1 to 65535" $listen) -}}
{{- end -}}
{{- if regexMatch "^(127\\.[0-9.]+|\\[::1\\]|localhost):" $listen -}}
{{- fail (printf "sidecar.adminListen=%s is a loopback address: the kubelet's probes (/healthz, /readyz) and Prometheus come to the pod IP, so the container would be restarted for failing its liveness probe; listen on 0.0.0.0:PORT, or on an IPv6 cluster [::]:PORT (opgate binds it IPv6 only: an IPv4 pod IP's probes would be refused) (the admin port serves only health, metrics and the active policy set)" $listen) -}}
{{- end -}}
{{- $old := .Values.sidecar.adminPort -}}
{{- if and $old (ne (toString $old) $port) -}}
{{- fail (printf "sidecar.adminPort (%v) is deprecated and disagrees with sidecar.adminListen (%s): the admin port is the one in sidecar.adminListen; drop sidecar.adminPort" $old $listen) -}}
{{- end -}}
{{- $port -}}
{{- end -}}

{{/*
An image's tag: (list tag default). A tag written as a number in a values file comes as a float
(20240101 would print as 2.0240101e+07): an integral one is printed as the integer it is.
*/}}
{{- define "opgate.imageTag" -}}
{{- $tag := index . 0 -}}
{{- if kindIs "float64" $tag }}{{ $tag = int64 $tag }}{{ end -}}
{{- toString ($tag | default (index . 1)) -}}
{{- end -}}

{{/* The audit log's directory (its volume's mountPath), when it is written to a file. */}}
{{- define "opgate.auditDir" -}}
{{- if and .Values.sidecar.audit.enabled (ne .Values.sidecar.audit.path "-") -}}
{{- dir .Values.sidecar.audit.path -}}
{{- end -}}
{{- end -}}

{{/* "true" when the capture has a volume of its own: not when it shares the audit log's directory. */}}
{{- define "opgate.captureVolume" -}}
{{- if and .Values.sidecar.capture.enabled (ne (dir .Values.sidecar.capture.path) (include "opgate.auditDir" .)) -}}
true
{{- end -}}
{{- end -}}

{{/*
The sidecar container and the pod volumes it needs. Other charts list opgate as a dependency
and inject them next to their controller container:
  containers:
    - name: controller
      ...
    {{- include "opgate.sidecar" . | nindent 8 }}
  volumes:
    {{- include "opgate.volumes" . | nindent 8 }}
(opgate.sidecar refuses sidecar.native, whose container belongs under initContainers:
opgate.initContainers and opgate.containers, above, place it either way)
Given a context whose .Values hold opgate's values (this chart's own, .Subcharts.<alias> for an
aliased dependency, or a dict with Values, Release and Chart), they use it; given a parent
chart's root context, they use the opgate subchart's (.Subcharts.opgate: the values under
`opgate:` with this chart's defaults, this chart's name and appVersion).
*/}}
{{- define "opgate.context" -}}
{{- $in := .in -}}
{{- if hasKey ($in.Values | default dict) "sidecar" -}}
{{- $_ := set .out "ctx" $in -}}
{{- else if and $in.Subcharts (hasKey $in.Subcharts "opgate") -}}
{{- $_ := set .out "ctx" (get $in.Subcharts "opgate") -}}
{{- else -}}
{{- fail "opgate.sidecar/opgate.volumes: pass a context with opgate's values: the root context of a chart that depends on opgate, .Subcharts.<alias> for an aliased dependency, or (dict \"Values\" .Values.opgate \"Release\" .Release \"Chart\" .Chart)" -}}
{{- end -}}
{{- include "opgate.fillAbsent" .out.ctx -}}
{{- end -}}

{{/*
"true" when the sidecar is a native one (given opgate's context): an init container with
restartPolicy Always, which kubelet starts (and waits for its startupProbe) before the pod's
containers and stops after them. sidecar.native: true, false, or auto: on a cluster of 1.29 or
later (SidecarContainers on by default; .Capabilities.KubeVersion is the apiserver's at helm
install, --kube-version's or helm's own at helm template).
*/}}
{{- define "opgate.native" -}}
{{- $native := .Values.sidecar.native -}}
{{- if eq (toString $native) "auto" -}}
{{- if not .Capabilities -}}
{{- fail "sidecar.native=auto reads the cluster's version from .Capabilities, which this context lacks: add \"Capabilities\" .Capabilities to the dict given to the opgate helpers, or set sidecar.native to true or false" -}}
{{- end -}}
{{- if semverCompare ">=1.29.0-0" .Capabilities.KubeVersion.Version }}true{{ end -}}
{{- else if eq (toString $native) "true" -}}
true
{{- end -}}
{{- end -}}

{{/*
The sidecar where sidecar.native puts it, for a parent chart whose pod works with either:
  initContainers:
    {{- include "opgate.initContainers" . | nindent 8 }}
  containers:
    - name: controller
      ...
    {{- include "opgate.containers" . | nindent 8 }}
opgate.initContainers renders it when it is native (nothing otherwise), opgate.containers when
it is not.
*/}}
{{- define "opgate.initContainers" -}}
{{- $r := dict -}}
{{- include "opgate.context" (dict "in" . "out" $r) -}}
{{- if include "opgate.native" $r.ctx }}{{ include "opgate.sidecarContainer" $r.ctx }}{{ end -}}
{{- end -}}

{{- define "opgate.containers" -}}
{{- $r := dict -}}
{{- include "opgate.context" (dict "in" . "out" $r) -}}
{{- if not (include "opgate.native" $r.ctx) }}{{ include "opgate.sidecarContainer" $r.ctx }}{{ end -}}
{{- end -}}

{{- /* a pod's containers entry (it knows no placement): a native sidecar there would be a
     container that restarts on its own and gets no preStop, which the apiserver of 1.35 takes */ -}}
{{- define "opgate.sidecar" -}}
{{- $r := dict -}}
{{- include "opgate.context" (dict "in" . "out" $r) -}}
{{- if include "opgate.native" $r.ctx -}}
{{- fail "opgate.sidecar renders a container for the pod's containers, and sidecar.native makes opgate a native sidecar, which belongs under initContainers: place it with include \"opgate.initContainers\" (under initContainers) and include \"opgate.containers\" (under containers) instead, or set sidecar.native=false" -}}
{{- end -}}
{{- include "opgate.sidecarContainer" $r.ctx -}}
{{- end -}}

{{- /* the container itself, given opgate's resolved context */ -}}
{{- define "opgate.sidecarContainer" -}}
{{- with . -}}
{{- $native := include "opgate.native" . -}}
{{- $listen := toString .Values.sidecar.listen -}}
{{- if not (or (hasPrefix "unix:" $listen) (regexMatch "^(127\\.[0-9.]+|\\[::1\\]|localhost):[0-9]+$" $listen)) -}}
{{- fail (printf "sidecar.listen=%s is not a loopback address: opgate adds the pod's ServiceAccount token to the calls it relays, so its API port must stay inside the pod (127.0.0.1:PORT, [::1]:PORT, localhost:PORT or unix:/path)" $listen) -}}
{{- end -}}
{{- if and (not (hasPrefix "unix:" $listen)) (or (lt (atoi (regexFind "[0-9]+$" $listen)) 1) (gt (atoi (regexFind "[0-9]+$" $listen)) 65535)) -}}
{{- fail (printf "sidecar.listen=%s: the port must be from 1 to 65535" $listen) -}}
{{- end -}}
{{- if and .Values.redis.passwordSecret.name (not .Values.redis.url) -}}
{{- fail (printf "redis.passwordSecret.name=%s without redis.url: opgate would not use Redis (nor the password) and the pod would wait for that Secret; set redis.url too, or drop redis.passwordSecret.name" .Values.redis.passwordSecret.name) -}}
{{- end -}}
{{- if include "opgate.holdsPassword" .Values.redis.url -}}
{{- fail "redis.url holds a password, which would stand in clear in the pod's args (kubectl get deployment -o yaml shows them to whoever may read Deployments): put it in a Secret and give its name in redis.passwordSecret.name (a username stays in the URL: redis://USER@HOST:PORT/DB), or, for a URL that must hold one (a Sentinel's ?sentinel_password=), leave redis.url empty and give the whole URL from a Secret as OPGATE_REDIS_URL in sidecar.env (valueFrom.secretKeyRef)" -}}
{{- end -}}
{{- range .Values.sidecar.env -}}
{{- if and (eq (toString .name) "OPGATE_REDIS_PASSWORD") .value -}}
{{- fail "sidecar.env has OPGATE_REDIS_PASSWORD with a value, which stands in clear in the Deployment (kubectl describe shows it): take it from a Secret (valueFrom.secretKeyRef), or give the Secret's name in redis.passwordSecret.name" -}}
{{- end -}}
{{- if and (eq (toString .name) "OPGATE_REDIS_URL") (include "opgate.holdsPassword" .value) -}}
{{- fail "sidecar.env has OPGATE_REDIS_URL with a value holding a password, which stands in clear in the Deployment (kubectl describe shows it): take the URL from a Secret (valueFrom.secretKeyRef), or put the password in a Secret named by redis.passwordSecret.name" -}}
{{- end -}}
{{- end -}}
{{- /* the flags rendered from values below: the same flag in sidecar.extraArgs (or a prefix
     of it, which opgate's parser takes as the flag) would win over the value, out of the
     chart's checks (a --listen on the pod IP) and its mounts, probes and ports */ -}}
{{- $own := dict "--listen" "sidecar.listen" "--admin-listen" "sidecar.adminListen" "--token-file" "sidecar.tokenFile" "--log-level" "sidecar.logLevel" "--header-timeout" "sidecar.headerTimeout" "--shutdown-grace" "sidecar.shutdownGraceSeconds" -}}
{{- if .Values.policies }}{{ $_ := set $own "--policies" "policies" }}{{ end -}}
{{- if not .Values.sidecar.accessLog }}{{ $_ := set $own "--no-access-log" "sidecar.accessLog" }}{{ end -}}
{{- if .Values.sidecar.audit.enabled }}{{ $_ := merge $own (dict "--audit-log" "sidecar.audit.path" "--audit-log-maxsize" "sidecar.audit.maxSizeMB" "--audit-log-maxbackup" "sidecar.audit.maxBackups") }}{{ end -}}
{{- if .Values.sidecar.capture.enabled }}{{ $_ := merge $own (dict "--capture" "sidecar.capture.path" "--capture-maxsize" "sidecar.capture.maxSizeMB" "--capture-maxbackup" "sidecar.capture.maxBackups") }}{{ end -}}
{{- if .Values.redis.url }}{{ $_ := merge $own (dict "--redis-url" "redis.url" "--replicas" "redis.replicas") }}{{ end -}}
{{- if .Values.redis.passwordSecret.name }}{{ $_ := set $own "--redis-password-file" "redis.passwordSecret" }}{{ end -}}
{{- /* --workers N (N > 1, or auto: one per CPU of the node) needs Redis and a TCP listener;
     opgate would refuse it at start, in a pod that restarts */ -}}
{{- $extra := .Values.sidecar.extraArgs | default list -}}
{{- $redis := .Values.redis.url -}}
{{- range .Values.sidecar.env }}{{ if eq (toString .name) "OPGATE_REDIS_URL" }}{{ $redis = true }}{{ end }}{{ end -}}
{{- /* each worker count asked for, as "<where it is> <N>": a flag of sidecar.extraArgs, or
     OPGATE_WORKERS in sidecar.env (opgate reads it when no flag is given) */ -}}
{{- $counts := list -}}
{{- range $i, $arg := $extra -}}
{{- $arg = toString $arg -}}
{{- if regexMatch "^--wo(r(k(e(r(s)?)?)?)?)?(=|$)" $arg -}}
{{- $n := "" -}}
{{- if contains "=" $arg }}{{ $n = regexReplaceAll "^[^=]*=" $arg "" }}{{ else if lt (add1 $i) (len $extra) }}{{ $n = toString (index $extra (add1 $i)) }}{{ end -}}
{{- $counts = append $counts (list "sidecar.extraArgs has --workers" $n) -}}
{{- end -}}
{{- end -}}
{{- range .Values.sidecar.env -}}
{{- if and (eq (toString .name) "OPGATE_WORKERS") (hasKey . "value") -}}
{{- $counts = append $counts (list "sidecar.env has OPGATE_WORKERS" (toString .value)) -}}
{{- end -}}
{{- end -}}
{{- $resources := .Values.sidecar.resources | default dict -}}
{{- range $counts -}}
{{- $where := index . 0 }}{{ $n := index . 1 -}}
{{- if ne (trim $n) "1" -}}
{{- if not $redis -}}
{{- fail (printf "%s %s without redis.url: each worker would keep its own rate-limit buckets (opgate refuses it at start); set redis.url, or run one worker" $where $n) -}}
{{- end -}}
{{- if hasPrefix "unix:" $listen -}}
{{- fail (printf "%s %s with sidecar.listen=%s: workers share a TCP port (opgate refuses a unix: socket with them at start); listen on a loopback HOST:PORT, or run one worker" $where $n $listen) -}}
{{- end -}}
{{- /* auto is one worker per CPU the container may use: without a CPU limit, every CPU of
     the node (~65 MB each: 64 on a 64-core node, OOM-killed under limits.memory) */ -}}
{{- if and (eq (lower (trim $n)) "auto") (not (dig "limits" "cpu" "" $resources)) -}}
{{- fail (printf "%s %s without sidecar.resources.limits.cpu: opgate would start one worker per CPU of the node (~65 MB each, under limits.memory %v), OOM-killed at every start on a large node; set sidecar.resources.limits.cpu (auto: one per CPU of it, rounded up), or a number of workers" $where $n (dig "limits" "memory" "none" $resources)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* kubelet evicts the pod (the operator with it) once an emptyDir passes its sizeLimit: a
     rotated file takes (maxBackups + 1) x maxSizeMB MiB per worker (each rotates its own);
     0 for either (never rotated, every backup kept) is unbounded, and left to the user */ -}}
{{- $workers := 1 -}}
{{- range $counts -}}
{{- $n := lower (trim (index . 1)) -}}
{{- if regexMatch "^[0-9]+$" $n }}{{ $workers = max $workers (atoi $n) }}{{ end -}}
{{- if eq $n "auto" }}{{ $workers = max $workers (int (ceil (include "opgate.quantity" (dig "limits" "cpu" "1" $resources)))) }}{{ end -}}
{{- end -}}
{{- $volumes := list -}}
{{- $auditDir := include "opgate.auditDir" . -}}
{{- if $auditDir -}}
{{- $files := list (list "the audit log's" .Values.sidecar.audit) -}}
{{- if and .Values.sidecar.capture.enabled (not (include "opgate.captureVolume" .)) -}}
{{- $files = append $files (list "the capture's" .Values.sidecar.capture) -}}
{{- end -}}
{{- $volumes = append $volumes (list "sidecar.audit.sizeLimit" .Values.sidecar.audit.sizeLimit $files) -}}
{{- end -}}
{{- if include "opgate.captureVolume" . -}}
{{- $volumes = append $volumes (list "sidecar.capture.sizeLimit" .Values.sidecar.capture.sizeLimit (list (list "the capture's" .Values.sidecar.capture))) -}}
{{- end -}}
{{- range $volumes -}}
{{- $value := index . 0 }}{{ $limit := index . 1 }}{{ $files := index . 2 -}}
{{- $mib := 0 }}{{ $terms := list }}{{ $bounded := true -}}
{{- range $files -}}
{{- $size := int (index . 1).maxSizeMB }}{{ $backups := int (index . 1).maxBackups -}}
{{- if or (eq $size 0) (eq $backups 0) }}{{ $bounded = false }}{{ end -}}
{{- $mib = add $mib (mul (add1 $backups) $size $workers) -}}
{{- $term := printf "(%d + 1) x %dMi x %d worker%s" $backups $size $workers (ternary "" "s" (eq $workers 1)) -}}
{{- $terms = append $terms (ternary $term (printf "%s %s" (index . 0) $term) (eq (len $files) 1)) -}}
{{- end -}}
{{- if and $bounded (gt (mulf $mib 1048576.0) (float64 (include "opgate.quantity" $limit))) -}}
{{- fail (printf "%s=%v is less than %s = %dMi, what the rotated files take: kubelet evicts the pod (the operator with it) once the emptyDir passes its sizeLimit; raise %s, or lower maxSizeMB or maxBackups" $value $limit (join " + " $terms) $mib $value) -}}
{{- end -}}
{{- end -}}
{{- range .Values.sidecar.extraArgs -}}
{{- $flag := regexReplaceAll "=.*$" (toString .) "" -}}
{{- if and (hasPrefix "--" $flag) (gt (len $flag) 2) -}}
{{- range $name, $value := $own -}}
{{- if hasPrefix $flag $name -}}
{{- fail (printf "sidecar.extraArgs has %s, which would override the chart's %s (set from %s): set %s instead" $flag $name $value $value) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
- name: opgate
  image: "{{ .Values.image.repository }}:{{ include "opgate.imageTag" (list .Values.image.tag .Chart.AppVersion) }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  {{- if $native }}
  # a native sidecar (in initContainers): kubelet starts the operator once the startupProbe
  # passes, and stops opgate once the operator has exited
  restartPolicy: Always
  {{- end }}
  args:
    - serve
    - --listen={{ .Values.sidecar.listen }}
    {{- /* opgate answers only the Host names of --accept-hosts (by default localhost,
         127.0.0.1 and [::1]: its guard against DNS rebinding); another loopback address is
         the name its clients (the kubeconfig's server) call it by */}}
    {{- $host := regexReplaceAll ":[0-9]+$" $listen "" }}
    {{- if not (or (hasPrefix "unix:" $listen) (has $host (list "127.0.0.1" "localhost" "[::1]"))) }}
    - --accept-hosts=^{{ regexQuoteMeta $host }}$
    {{- end }}
    - --admin-listen={{ .Values.sidecar.adminListen }}
    {{- if .Values.policies }}
    - --policies=/etc/opgate/policies
    {{- end }}
    - --token-file={{ .Values.sidecar.tokenFile }}
    - --log-level={{ .Values.sidecar.logLevel }}
    - --header-timeout={{ .Values.sidecar.headerTimeout }}
    - --shutdown-grace={{ .Values.sidecar.shutdownGraceSeconds }}
    {{- if not .Values.sidecar.accessLog }}
    - --no-access-log
    {{- end }}
    {{- if .Values.sidecar.audit.enabled }}
    - --audit-log={{ .Values.sidecar.audit.path }}
    - --audit-log-maxsize={{ .Values.sidecar.audit.maxSizeMB }}
    - --audit-log-maxbackup={{ .Values.sidecar.audit.maxBackups }}
    {{- end }}
    {{- if .Values.sidecar.capture.enabled }}
    - --capture={{ .Values.sidecar.capture.path }}
    - --capture-maxsize={{ .Values.sidecar.capture.maxSizeMB }}
    - --capture-maxbackup={{ .Values.sidecar.capture.maxBackups }}
    {{- end }}
    {{- if .Values.redis.url }}
    - --redis-url={{ .Values.redis.url }}
    - --replicas={{ .Values.redis.replicas | default (max 1 (int .Values.operator.replicas)) }}
    {{- end }}
    {{- if .Values.redis.passwordSecret.name }}
    - --redis-password-file=/etc/opgate/redis/{{ .Values.redis.passwordSecret.key }}
    {{- end }}
    {{- range .Values.sidecar.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  {{- with .Values.sidecar.env }}
  env:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  ports:
    - {name: admin, containerPort: {{ include "opgate.adminPort" . }}, protocol: TCP}
  livenessProbe:
    httpGet: {path: /healthz, port: admin}
    periodSeconds: 10
  readinessProbe:
    httpGet: {path: /readyz, port: admin}
    periodSeconds: 5
    # /readyz asks the apiserver (/readyz, then /version), up to 3 s each: the kubelet's
    # default 1 s would count a loaded apiserver's slower answer as a failure
    timeoutSeconds: 7
  # /healthz answers once the API port listens: a native sidecar's gates the operator's start
  startupProbe:
    httpGet: {path: /healthz, port: admin}
    periodSeconds: 1
    failureThreshold: 30
  {{- if and .Values.sidecar.shutdownDelaySeconds (not $native) }}
  # the operator stops first: its last calls still go through (see sidecar.shutdownDelaySeconds)
  lifecycle:
    preStop:
      exec: {command: [sleep, {{ .Values.sidecar.shutdownDelaySeconds | quote }}]}
  {{- end }}
  resources:
    {{- toYaml .Values.sidecar.resources | nindent 4 }}
  # the restricted Pod Security Standard on the container itself: a parent chart's pod that
  # injects it need not set a pod-level seccompProfile (this chart's pod does)
  securityContext:
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    runAsNonRoot: true
    capabilities: {drop: [ALL]}
    seccompProfile: {type: RuntimeDefault}
  {{- $mounts := list (dict "name" "opgate-tmp" "mountPath" "/tmp") }}
  {{- if .Values.policies }}
  {{- $mounts = prepend $mounts (dict "name" "opgate-policies" "mountPath" "/etc/opgate/policies" "readOnly" true) }}
  {{- end }}
  {{- if .Values.redis.passwordSecret.name }}
  {{- $mounts = append $mounts (dict "name" "opgate-redis" "mountPath" "/etc/opgate/redis" "readOnly" true) }}
  {{- end }}
  {{- $auditDir := include "opgate.auditDir" . }}
  {{- if $auditDir }}
  {{- $mounts = append $mounts (dict "name" "opgate-audit" "mountPath" $auditDir) }}
  {{- end }}
  {{- if include "opgate.captureVolume" . }}
  {{- $mounts = append $mounts (dict "name" "opgate-capture" "mountPath" (dir .Values.sidecar.capture.path)) }}
  {{- end }}
  {{- $mounts = concat $mounts (.Values.sidecar.extraVolumeMounts | default list) }}
  {{- $seen := dict }}
  {{- range $mounts }}
  {{- if hasKey $seen .mountPath }}
  {{- fail (printf "opgate sidecar: %s and %s are both mounted at %s; give sidecar.audit.path, sidecar.capture.path and sidecar.extraVolumeMounts directories of their own (the audit log and the capture may share one)" (get $seen .mountPath) .name .mountPath) }}
  {{- end }}
  {{- $_ := set $seen .mountPath .name }}
  {{- end }}
  {{- /* the root filesystem is read-only: a socket's directory must be a writable mount */}}
  {{- if hasPrefix "unix:" $listen }}
  {{- $sockDir := dir (trimPrefix "unix:" $listen) }}
  {{- $writable := false }}
  {{- range $mounts }}
  {{- if and (not .readOnly) (or (eq $sockDir (trimSuffix "/" .mountPath)) (hasPrefix (printf "%s/" (trimSuffix "/" .mountPath)) $sockDir)) }}
  {{- $writable = true }}
  {{- end }}
  {{- end }}
  {{- if not $writable }}
  {{- fail (printf "sidecar.listen=%s: %s is on no writable mount of the sidecar (its root filesystem is read-only, and the operator must reach the socket): mount a volume of extraVolumes there with sidecar.extraVolumeMounts and operator.extraVolumeMounts" $listen $sockDir) }}
  {{- end }}
  {{- end }}
  volumeMounts:
    {{- toYaml $mounts | nindent 4 }}
{{- end }}
{{- end -}}

{{- define "opgate.volumes" -}}
{{- $r := dict -}}
{{- include "opgate.context" (dict "in" . "out" $r) -}}
{{- with $r.ctx -}}
{{- if .Values.policies }}
- name: opgate-policies
  configMap:
    name: {{ include "opgate.suffixedName" (list . "policies") }}
{{- end }}
- name: opgate-tmp
  emptyDir:
    sizeLimit: {{ .Values.sidecar.tmpSizeLimit }}
{{- if .Values.redis.passwordSecret.name }}
- name: opgate-redis
  secret:
    secretName: {{ .Values.redis.passwordSecret.name }}
{{- end }}
{{- if include "opgate.auditDir" . }}
- name: opgate-audit
  emptyDir:
    sizeLimit: {{ .Values.sidecar.audit.sizeLimit }}
{{- end }}
{{- if include "opgate.captureVolume" . }}
- name: opgate-capture
  emptyDir:
    sizeLimit: {{ .Values.sidecar.capture.sizeLimit }}
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end -}}
{{- end -}}
