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

{{- /* What the operator needs, and nothing more: read RLRuns and write their status; the same
for EnginePools, with their finalizer; manage the
kinds of objects a run owns; read the runs' pods (why a run is stuck: docs/operator.md); publish
events; agent-sandbox's objects for runs that use it. The Roles it creates for runs grant only verbs it holds itself (Kubernetes refuses
privilege escalation), hence the endpointslices rule. The same rules go in a ClusterRole, or in
a Role in each of watchNamespaces. */ -}}
{{- define "moult-operator.rules" -}}
- apiGroups: [moult.dev]
  resources: [rlruns]
  verbs: [get, list, watch]
- apiGroups: [moult.dev]
  resources: [rlruns/status]
  verbs: [get, patch, update]
{{- /* EnginePools (docs/operator.md, "Engine pools"): their status, and the finalizer a pool
keeps while runs name it (patch on the pool; update on enginepools/finalizers where the
OwnerReferencesPermissionEnforcement admission plugin asks for it to own the pool's children).
enginepools/scale for HPAs and kubectl scale through the operator's own account. */}}
- apiGroups: [moult.dev]
  resources: [enginepools]
  verbs: [get, list, watch, patch, update]
- apiGroups: [moult.dev]
  resources: [enginepools/status, enginepools/scale]
  verbs: [get, patch, update]
- apiGroups: [moult.dev]
  resources: [enginepools/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [configmaps, secrets, serviceaccounts, services]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
{{- /* A StatefulSet's FailedCreate events: why it could not create a pod (a ResourceQuota). */}}
- apiGroups: [""]
  resources: [events]
  verbs: [get, list, watch]
- apiGroups: [apps]
  resources: [statefulsets, deployments]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, update, delete]
{{- /* Runs' PodDisruptionBudgets (--disruption-budgets): listed and watched even when off, so
that the budgets of an earlier start with it on are deleted. */}}
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- /* kubernetes-sigs/agent-sandbox, for runs with spec.agent.sandbox: the run's template and
warm pool, and what the Role of its agent pods grants them (claims, sandboxes). */}}
- apiGroups: [extensions.agents.x-k8s.io]
  resources: [sandboxtemplates, sandboxwarmpools]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [extensions.agents.x-k8s.io]
  resources: [sandboxclaims]
  verbs: [create, get, list, delete, deletecollection]
- apiGroups: [agents.x-k8s.io]
  resources: [sandboxes]
  verbs: [create, get, list, delete, deletecollection]
{{- /* Kueue, for runs with a queue: the run's Workload, and the status writes Kueue leaves to a
Workload's owner (quota given back after an eviction, finished). */}}
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads]
  verbs: [get, list, watch, create, patch, update, delete]
- apiGroups: [kueue.x-k8s.io]
  resources: [workloads/status]
  verbs: [get, update, patch]
{{- end -}}
