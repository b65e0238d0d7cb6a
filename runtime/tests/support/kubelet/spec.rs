//! Pod spec -> local launches: the translation half of the local kubelet (see the parent
//! module's doc for the rules): volumes, environment, `$(VAR)` expansion, mount paths, Service
//! and pod addresses, and the pod's identity.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, EnvVarSource, KeyToPath, Pod, Secret, Service, ServiceAccount,
};
use kube::api::{Api, ListParams, PostParams};
use kube::config::Kubeconfig;
use kube::{Client, ResourceExt};

use super::Shared;

/// A container ready to run.
pub(super) struct Launch {
    pub(super) container: String,
    pub(super) program: PathBuf,
    pub(super) args: Vec<String>,
    pub(super) env: Vec<(String, String)>,
    pub(super) dir: PathBuf,
    pub(super) log: PathBuf,
}

/// Why a pod cannot start yet (`Wait`: something it needs does not exist yet) or at all.
pub(super) enum Problem {
    Wait(String),
    Fatal(String),
}

/// Resolves volumes, identity and environment of every container, and rewrites paths and
/// addresses; the names of Services and pods referred to that have no running pod yet come back
/// beside the launches.
pub(super) async fn prepare(
    shared: &Shared,
    pod: &Pod,
    ip: &str,
    dir: &Path,
) -> Result<(Vec<Launch>, BTreeSet<String>), Problem> {
    let spec = pod
        .spec
        .as_ref()
        .ok_or_else(|| Problem::Fatal("the pod has no spec".into()))?;
    std::fs::create_dir_all(dir)
        .map_err(|e| Problem::Fatal(format!("making {}: {e}", dir.display())))?;
    let volumes = volumes(shared, pod, dir).await?;
    let kubeconfig = identity(shared, pod, dir).await?;
    let network = Network::load(&shared.client, &shared.namespace)
        .await
        .map_err(|e| Problem::Wait(format!("listing Services and pods: {e}")))?;
    let mut pending = BTreeSet::new();
    let mut launches = Vec::new();
    for c in &spec.containers {
        let vars = container_env(shared, pod, ip, c).await?;
        let command = c.command.clone().unwrap_or_default();
        let Some(first) = command.first() else {
            let why = format!(
                "container {} has no command: its image's entrypoint is unknown here",
                c.name
            );
            return Err(Problem::Fatal(why));
        };
        let mounts = mounts(c, &volumes);
        let image = &shared.opts.image;
        let loopback = pod_loopback(ip);
        let mut local = |text: &str| {
            let text = rewrite_paths(text, &mounts, image)
                .replace("0.0.0.0", ip)
                .replace("127.0.0.1", &loopback);
            network.rewrite(&text, &mut pending)
        };
        let program = match shared.opts.binaries.get(first) {
            Some(p) => p.clone(),
            None => PathBuf::from(rewrite_paths(&expand(first, &vars), &mounts, image)),
        };
        let args = command[1..]
            .iter()
            .chain(c.args.iter().flatten())
            .map(|a| local(&expand(a, &vars)))
            .collect();
        // A pod that does not mount its token everywhere gives it to the containers that mount a
        // projected ServiceAccount token.
        let automount = pod
            .spec
            .as_ref()
            .and_then(|s| s.automount_service_account_token);
        let credential = automount != Some(false) || mounts_token(pod, c);
        let mut env: Vec<(String, String)> = (kubeconfig.iter().filter(|_| credential))
            .map(|k| ("KUBECONFIG".to_string(), k.display().to_string()))
            .collect();
        env.extend(shared.opts.env.iter().cloned());
        env.extend(vars.iter().map(|(k, v)| (k.clone(), local(v))));
        launches.push(Launch {
            container: c.name.clone(),
            program,
            args,
            env,
            dir: dir.to_path_buf(),
            log: shared.log_path(&pod.name_any(), &c.name),
        });
    }
    Ok((launches, pending))
}

/// The pod's own loopback address: `127.` and the last three parts of its IP (all of 127/8 is
/// this machine's loopback), so that two pods' loopback servers never share an address.
fn pod_loopback(ip: &str) -> String {
    let parts: Vec<&str> = ip.split('.').collect();
    format!("127.{}", parts[parts.len().saturating_sub(3)..].join("."))
}

/// The local folder of every volume of the pod that has one.
async fn volumes(
    shared: &Shared,
    pod: &Pod,
    dir: &Path,
) -> Result<BTreeMap<String, PathBuf>, Problem> {
    let mut out = BTreeMap::new();
    let fatal = |e: std::io::Error| Problem::Fatal(format!("writing a volume: {e}"));
    for v in pod.spec.iter().flat_map(|s| s.volumes.iter().flatten()) {
        let local = dir.join("volumes").join(&v.name);
        let path = if let Some(cm) = &v.config_map {
            let files = data(shared, Kind::ConfigMap, &cm.name, cm.optional).await?;
            write_files(&local, &files, cm.items.as_deref()).map_err(fatal)?;
            local
        } else if let Some(s) = &v.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            let files = data(shared, Kind::Secret, &name, s.optional).await?;
            write_files(&local, &files, s.items.as_deref()).map_err(fatal)?;
            local
        } else if v.empty_dir.is_some() {
            std::fs::create_dir_all(&local).map_err(fatal)?;
            local
        } else if let Some(pvc) = &v.persistent_volume_claim {
            match shared.opts.claims.get(&pvc.claim_name) {
                Some(p) => p.clone(),
                None => {
                    let why = format!(
                        "volume {}: claim {} is not in KubeletOptions::claims",
                        v.name, pvc.claim_name
                    );
                    return Err(Problem::Fatal(why));
                }
            }
        } else if let Some(h) = &v.host_path {
            PathBuf::from(&h.path)
        } else {
            continue;
        };
        out.insert(v.name.clone(), path);
    }
    Ok(out)
}

/// A file per key (or per item) of a ConfigMap or Secret.
fn write_files(
    dir: &Path,
    files: &BTreeMap<String, Vec<u8>>,
    items: Option<&[KeyToPath]>,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let chosen: Vec<(&str, &str)> = match items {
        Some(items) => items
            .iter()
            .map(|i| (i.key.as_str(), i.path.as_str()))
            .collect(),
        None => files.keys().map(|k| (k.as_str(), k.as_str())).collect(),
    };
    for (key, path) in chosen {
        let Some(bytes) = files.get(key) else {
            continue;
        };
        let target = dir.join(path);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(target, bytes)?;
    }
    Ok(())
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    ConfigMap,
    Secret,
}

/// The data of a ConfigMap or Secret (decoded); empty when it is missing and `optional`.
async fn data(
    shared: &Shared,
    kind: Kind,
    name: &str,
    optional: Option<bool>,
) -> Result<BTreeMap<String, Vec<u8>>, Problem> {
    let (client, ns) = (shared.client.clone(), shared.namespace.as_str());
    let wait = |e: kube::Error| Problem::Wait(format!("{kind:?} {name}: {e}"));
    let found = match kind {
        Kind::ConfigMap => Api::<ConfigMap>::namespaced(client, ns)
            .get_opt(name)
            .await
            .map_err(wait)?
            .map(|cm| {
                let text = cm
                    .data
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k, v.into_bytes()));
                let binary = cm.binary_data.into_iter().flatten().map(|(k, v)| (k, v.0));
                text.chain(binary).collect()
            }),
        Kind::Secret => Api::<Secret>::namespaced(client, ns)
            .get_opt(name)
            .await
            .map_err(wait)?
            .map(|s| {
                s.data
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k, v.0))
                    .collect()
            }),
    };
    match found {
        Some(data) => Ok(data),
        None if optional == Some(true) => Ok(BTreeMap::new()),
        None => Err(Problem::Wait(format!("{kind:?} {name}"))),
    }
}

/// The container's environment (`envFrom`, then `env`), expanded and resolved.
async fn container_env(
    shared: &Shared,
    pod: &Pod,
    ip: &str,
    c: &Container,
) -> Result<Vec<(String, String)>, Problem> {
    // A later definition of a name replaces the earlier one.
    fn set(vars: &mut Vec<(String, String)>, name: String, value: String) {
        vars.retain(|(k, _)| *k != name);
        vars.push((name, value));
    }
    let mut vars: Vec<(String, String)> = Vec::new();
    for from in c.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        let data = if let Some(r) = &from.config_map_ref {
            data(shared, Kind::ConfigMap, &r.name, r.optional).await?
        } else if let Some(r) = &from.secret_ref {
            data(shared, Kind::Secret, &r.name, r.optional).await?
        } else {
            continue;
        };
        for (k, v) in data {
            set(
                &mut vars,
                format!("{prefix}{k}"),
                String::from_utf8_lossy(&v).into_owned(),
            );
        }
    }
    for e in c.env.iter().flatten() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), _) => Some(expand(v, &vars)),
            (None, Some(from)) => value_from(shared, pod, ip, from).await?,
            (None, None) => Some(String::new()),
        };
        if let Some(value) = value {
            set(&mut vars, e.name.clone(), value);
        }
    }
    Ok(vars)
}

/// One `valueFrom`; None for an optional key that is missing.
async fn value_from(
    shared: &Shared,
    pod: &Pod,
    ip: &str,
    from: &EnvVarSource,
) -> Result<Option<String>, Problem> {
    let (kind, name, key, optional) = if let Some(r) = &from.secret_key_ref {
        (Kind::Secret, &r.name, &r.key, r.optional)
    } else if let Some(r) = &from.config_map_key_ref {
        (Kind::ConfigMap, &r.name, &r.key, r.optional)
    } else if let Some(f) = &from.field_ref {
        return field(pod, ip, &f.field_path).map(Some);
    } else {
        return Err(Problem::Fatal(format!("unsupported env source {from:?}")));
    };
    let data = data(shared, kind, name, optional).await?;
    match data.get(key) {
        Some(v) => Ok(Some(String::from_utf8_lossy(v).into_owned())),
        None if optional == Some(true) => Ok(None),
        None => Err(Problem::Wait(format!("key {key} of {kind:?} {name}"))),
    }
}

/// A `fieldRef` of the pod.
fn field(pod: &Pod, ip: &str, path: &str) -> Result<String, Problem> {
    let m = &pod.metadata;
    let spec = pod.spec.as_ref();
    let quoted = |map: &str| {
        path.strip_prefix(&format!("{map}['"))
            .and_then(|rest| rest.strip_suffix("']"))
            .map(str::to_string)
    };
    let value = match path {
        "metadata.name" => m.name.clone(),
        "metadata.namespace" => m.namespace.clone(),
        "metadata.uid" => m.uid.clone(),
        "status.podIP" => Some(ip.to_string()),
        "status.hostIP" => pod.status.as_ref().and_then(|s| s.host_ip.clone()),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()),
        "spec.serviceAccountName" => spec.and_then(|s| s.service_account_name.clone()),
        _ => {
            if let Some(k) = quoted("metadata.labels") {
                m.labels.as_ref().and_then(|l| l.get(&k).cloned())
            } else if let Some(k) = quoted("metadata.annotations") {
                m.annotations.as_ref().and_then(|a| a.get(&k).cloned())
            } else {
                return Err(Problem::Fatal(format!("unsupported fieldRef {path}")));
            }
        }
    };
    Ok(value.unwrap_or_default())
}

/// `$(VAR)` -> the value of the last `VAR` in `vars`, as the kubelet expands: `$$` is a
/// literal `$`, and a reference to an undefined variable stays as it is.
fn expand(text: &str, vars: &[(String, String)]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        if rest.starts_with("$$") {
            out.push('$');
            i += 2;
            continue;
        }
        if let Some(inner) = rest.strip_prefix("$(") {
            if let Some(close) = inner.find(')') {
                let name = &inner[..close];
                if let Some((_, value)) = vars.iter().rev().find(|(k, _)| k == name) {
                    out.push_str(value);
                    i += 2 + close + 1;
                    continue;
                }
            }
        }
        let c = rest.chars().next().expect("i is inside the text");
        out.push(c);
        i += c.len_utf8();
    }
    out
}

/// A container's mounts as (mountPath, local folder), longest mountPath first.
fn mounts(c: &Container, volumes: &BTreeMap<String, PathBuf>) -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = c
        .volume_mounts
        .iter()
        .flatten()
        .filter_map(|m| {
            let base = volumes.get(&m.name)?;
            let path = m.mount_path.trim_end_matches('/');
            let local = match m.sub_path.as_deref() {
                Some(sub) if !sub.is_empty() => base.join(sub),
                _ => base.clone(),
            };
            (!path.is_empty()).then(|| (path.to_string(), local))
        })
        .collect();
    out.sort_by_key(|(path, _)| std::cmp::Reverse(path.len()));
    out
}

fn is_path_char(c: char) -> bool {
    c.is_alphanumeric() || "._-/~+@%".contains(c)
}

/// Whether `rest` starts with the whole path `path` (followed by `/` or the end of the path).
fn starts_with_path(rest: &str, path: &str) -> bool {
    rest.starts_with(path)
        && rest[path.len()..]
            .chars()
            .next()
            .is_none_or(|c| c == '/' || !is_path_char(c))
}

/// Every whole-prefix occurrence of a mountPath in `text` -> its local folder, in one pass (a
/// replacement is never rewritten again, even when the local folder lies under another
/// mountPath such as `/tmp`), except paths under an `image` folder, which stay as they are.
/// `mounts` come longest first.
fn rewrite_paths(text: &str, mounts: &[(String, PathBuf)], image: &[PathBuf]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut prev: Option<char> = None;
    let mut i = 0;
    while i < text.len() {
        let rest = &text[i..];
        let at_start = prev.is_none_or(|c| !is_path_char(c));
        let in_image = || {
            image
                .iter()
                .any(|dir| starts_with_path(rest, &dir.to_string_lossy()))
        };
        let hit = (at_start && !in_image())
            .then(|| mounts.iter().find(|(path, _)| starts_with_path(rest, path)));
        if let Some((path, local)) = hit.flatten() {
            out.push_str(&local.to_string_lossy());
            i += path.len();
            prev = path.chars().last();
            continue;
        }
        let c = rest.chars().next().expect("i is inside the text");
        out.push(c);
        prev = Some(c);
        i += c.len_utf8();
    }
    out
}

/// Whether container `c` mounts a projected volume holding the pod's ServiceAccount token.
fn mounts_token(pod: &Pod, c: &k8s_openapi::api::core::v1::Container) -> bool {
    let volumes = pod.spec.as_ref().and_then(|s| s.volumes.as_ref());
    let tokens: Vec<&str> = (volumes.into_iter().flatten())
        .filter(|v| {
            let sources = v.projected.as_ref().and_then(|p| p.sources.as_ref());
            sources
                .into_iter()
                .flatten()
                .any(|s| s.service_account_token.is_some())
        })
        .map(|v| v.name.as_str())
        .collect();
    (c.volume_mounts.iter().flatten()).any(|m| tokens.contains(&m.name.as_str()))
}

/// The pod's `KUBECONFIG`: its ServiceAccount, with a token bound to the pod (for every
/// container, or those that mount a projected token where the pod does not automount it).
async fn identity(shared: &Shared, pod: &Pod, dir: &Path) -> Result<Option<PathBuf>, Problem> {
    let Some(admin) = &shared.opts.kubeconfig else {
        return Ok(None);
    };
    let Some(spec) = &pod.spec else {
        return Ok(None);
    };
    let projected = (spec.containers.iter()).any(|c| mounts_token(pod, c));
    if spec.automount_service_account_token == Some(false) && !projected {
        return Ok(None);
    }
    let account = spec.service_account_name.as_deref().unwrap_or("default");
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: pod.metadata.name.clone(),
                uid: pod.metadata.uid.clone(),
            }),
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        }),
        ..TokenRequest::default()
    };
    let api: Api<ServiceAccount> = Api::namespaced(shared.client.clone(), &shared.namespace);
    let token = api
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .map_err(|e| Problem::Wait(format!("a token of ServiceAccount {account}: {e}")))?
        .status
        .map(|s| s.token)
        .ok_or_else(|| Problem::Wait(format!("a token of ServiceAccount {account}")))?;
    let fatal = |why: String| Problem::Fatal(format!("{}: {why}", admin.display()));
    let kc = Kubeconfig::read_from(admin).map_err(|e| fatal(e.to_string()))?;
    let context = kc
        .contexts
        .iter()
        .find(|c| Some(&c.name) == kc.current_context.as_ref())
        .and_then(|c| c.context.as_ref())
        .ok_or_else(|| fatal("no current context".into()))?;
    let cluster = kc
        .clusters
        .iter()
        .find(|c| c.name == context.cluster)
        .and_then(|c| c.cluster.as_ref())
        .ok_or_else(|| fatal(format!("no cluster {}", context.cluster)))?;
    let mut server = serde_json::json!({ "server": cluster.server });
    if let Some(ca) = &cluster.certificate_authority {
        let ca = admin.parent().unwrap_or(Path::new("/")).join(ca);
        server["certificate-authority"] = ca.display().to_string().into();
    }
    if let Some(ca) = &cluster.certificate_authority_data {
        server["certificate-authority-data"] = ca.clone().into();
    }
    // JSON is YAML: kube and kubectl read it as a kubeconfig.
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{ "name": "cluster", "cluster": server }],
        "users": [{ "name": account, "user": { "token": token } }],
        "contexts": [{
            "name": "pod",
            "context": { "cluster": "cluster", "user": account, "namespace": shared.namespace },
        }],
        "current-context": "pod",
    });
    let path = dir.join("kubeconfig");
    std::fs::create_dir_all(dir)
        .and_then(|()| {
            std::fs::write(
                &path,
                serde_json::to_vec_pretty(&config).unwrap_or_default(),
            )
        })
        .map_err(|e| Problem::Fatal(format!("writing {}: {e}", path.display())))?;
    Ok(Some(path))
}

/// What the namespace's names resolve to right now.
#[derive(Debug, Default)]
struct Network {
    namespace: String,
    /// Every Service with a selector -> the IP of a running pod it selects, if any.
    services: BTreeMap<String, Option<String>>,
    /// Every Service name (a pod's `subdomain` names one).
    names: BTreeSet<String>,
    /// (hostname, subdomain) -> IP of running pods.
    pods: BTreeMap<(String, String), String>,
}

impl Network {
    async fn load(client: &Client, namespace: &str) -> kube::Result<Network> {
        let lp = ListParams::default();
        let services = Api::<Service>::namespaced(client.clone(), namespace)
            .list(&lp)
            .await?;
        let mut pods = Api::<Pod>::namespaced(client.clone(), namespace)
            .list(&lp)
            .await?
            .items;
        pods.sort_by_key(|p| p.name_any());
        let running = |p: &&Pod| {
            p.metadata.deletion_timestamp.is_none()
                && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
        };
        let ip = |p: &Pod| p.status.as_ref().and_then(|s| s.pod_ip.clone());
        let mut net = Network {
            namespace: namespace.to_string(),
            ..Network::default()
        };
        for svc in &services.items {
            let name = svc.name_any();
            net.names.insert(name.clone());
            let Some(selector) = svc.spec.as_ref().and_then(|s| s.selector.as_ref()) else {
                continue;
            };
            let backend = pods
                .iter()
                .filter(running)
                .filter(|p| selector.iter().all(|(k, v)| p.labels().get(k) == Some(v)))
                .find_map(ip);
            net.services.insert(name, backend);
        }
        for p in pods.iter().filter(running) {
            let spec = p.spec.as_ref();
            let host = spec.and_then(|s| s.hostname.clone());
            let sub = spec.and_then(|s| s.subdomain.clone());
            if let (Some(host), Some(sub), Some(ip)) = (host, sub, ip(p)) {
                net.pods.insert((host, sub), ip);
            }
        }
        Ok(net)
    }

    /// Service URLs and pod DNS names in `text` -> pod IPs; what has no running pod yet is
    /// added to `pending` and left as it is.
    fn rewrite(&self, text: &str, pending: &mut BTreeSet<String>) -> String {
        let mut out = self.rewrite_pod_names(text, pending);
        let ns = &self.namespace;
        for (svc, ip) in &self.services {
            for scheme in ["http", "https"] {
                for host in [
                    format!("{svc}.{ns}.svc.cluster.local"),
                    format!("{svc}.{ns}.svc"),
                    svc.clone(),
                ] {
                    let from = format!("{scheme}://{host}:");
                    if !out.contains(&from) {
                        continue;
                    }
                    match ip {
                        Some(ip) => out = out.replace(&from, &format!("{scheme}://{ip}:")),
                        None => {
                            pending.insert(format!("Service {svc}"));
                        }
                    }
                }
            }
        }
        out
    }

    /// `<hostname>.<subdomain>.<ns>.svc[.cluster.local]` -> the pod's IP.
    fn rewrite_pod_names(&self, text: &str, pending: &mut BTreeSet<String>) -> String {
        let is_label = |c: char| c.is_ascii_alphanumeric() || c == '-';
        let ns = &self.namespace;
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        loop {
            let hit = self
                .names
                .iter()
                .filter_map(|svc| {
                    let suffix = format!(".{svc}.{ns}.svc");
                    rest.find(&suffix).map(|i| (i, svc, suffix.len()))
                })
                .min_by_key(|(i, _, _)| *i);
            let Some((i, svc, len)) = hit else {
                out.push_str(rest);
                return out;
            };
            let host_start = rest[..i].rfind(|c: char| !is_label(c)).map_or(0, |j| j + 1);
            let host = &rest[host_start..i];
            let mut end = i + len;
            if rest[end..].starts_with(".cluster.local") {
                end += ".cluster.local".len();
            }
            let whole = rest[end..]
                .chars()
                .next()
                .is_none_or(|c| !is_label(c) && c != '.');
            if host.is_empty() || !whole {
                out.push_str(&rest[..i + 1]);
                rest = &rest[i + 1..];
                continue;
            }
            match self.pods.get(&(host.to_string(), svc.clone())) {
                Some(ip) => {
                    out.push_str(&rest[..host_start]);
                    out.push_str(ip);
                }
                None => {
                    pending.insert(format!("pod {host}.{svc}"));
                    out.push_str(&rest[..end]);
                }
            }
            rest = &rest[end..];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn expand_follows_the_kubelet() {
        let v = vars(&[("A", "1"), ("B", "two")]);
        assert_eq!(expand("x=$(A)/$(B)", &v), "x=1/two");
        assert_eq!(expand("$(C) $$(A) $$ $(A", &v), "$(C) $(A) $ $(A");
    }

    #[test]
    fn mount_paths_are_rewritten_once_and_only_as_whole_prefixes() {
        let mounts = vec![
            (
                "/etc/moult".to_string(),
                PathBuf::from("/tmp/k/pods/p/volumes/config"),
            ),
            (
                "/tmp".to_string(),
                PathBuf::from("/tmp/k/pods/p/volumes/tmp"),
            ),
        ];
        let cases = [
            (
                "/etc/moult/rlrun.yaml",
                "/tmp/k/pods/p/volumes/config/rlrun.yaml",
            ),
            ("/tmp", "/tmp/k/pods/p/volumes/tmp"),
            (
                "--out=/tmp/x:/tmp",
                "--out=/tmp/k/pods/p/volumes/tmp/x:/tmp/k/pods/p/volumes/tmp",
            ),
            ("/var/tmp/x", "/var/tmp/x"),
            ("/tmpfile", "/tmpfile"),
            ("http://h/tmp", "http://h/tmp"),
        ];
        for (text, want) in cases {
            assert_eq!(rewrite_paths(text, &mounts, &[]), want, "{text}");
        }
    }

    #[test]
    fn paths_in_the_image_are_not_hidden_by_a_volume_mounted_above_them() {
        let mounts = vec![(
            "/tmp".to_string(),
            PathBuf::from("/tmp/k/pods/p/volumes/tmp"),
        )];
        let image = [PathBuf::from("/tmp/clone")];
        let cases = [
            (
                "--model=/tmp/clone/runtime/../examples/m",
                "--model=/tmp/clone/runtime/../examples/m",
            ),
            ("/tmp/clone", "/tmp/clone"),
            ("/tmp/clone2/x", "/tmp/k/pods/p/volumes/tmp/clone2/x"),
            (
                "/tmp/x:/tmp/clone/y",
                "/tmp/k/pods/p/volumes/tmp/x:/tmp/clone/y",
            ),
        ];
        for (text, want) in cases {
            assert_eq!(rewrite_paths(text, &mounts, &image), want, "{text}");
        }
    }

    #[test]
    fn each_pod_has_a_loopback_address_of_its_own() {
        assert_eq!(pod_loopback("10.244.0.5"), "127.244.0.5");
        assert_ne!(pod_loopback("10.244.1.5"), pod_loopback("10.244.0.5"));
    }

    #[test]
    fn service_urls_and_pod_names_resolve_to_pod_ips() {
        let net = Network {
            namespace: "ns".into(),
            services: BTreeMap::from([
                (
                    "run-coordinator".to_string(),
                    Some("10.244.0.5".to_string()),
                ),
                ("run-engine".to_string(), None),
            ]),
            names: ["run-coordinator", "run-engine", "run-trainer"]
                .map(String::from)
                .into(),
            pods: BTreeMap::from([(
                ("run-trainer-0".to_string(), "run-trainer".to_string()),
                "10.244.0.7".to_string(),
            )]),
        };
        let mut pending = BTreeSet::new();
        let cases = [
            ("http://run-coordinator:8080", "http://10.244.0.5:8080"),
            (
                "https://run-coordinator.ns.svc.cluster.local:1/x",
                "https://10.244.0.5:1/x",
            ),
            ("run-trainer-0.run-trainer.ns.svc", "10.244.0.7"),
            (
                "tcp://run-trainer-0.run-trainer.ns.svc.cluster.local:29500",
                "tcp://10.244.0.7:29500",
            ),
            ("run-engine", "run-engine"),
            ("run-coordinator", "run-coordinator"),
        ];
        for (text, want) in cases {
            assert_eq!(net.rewrite(text, &mut pending), want, "{text}");
        }
        assert!(pending.is_empty(), "{pending:?}");
        net.rewrite(
            "http://run-engine:8000 run-trainer-1.run-trainer.ns.svc",
            &mut pending,
        );
        let want = ["Service run-engine", "pod run-trainer-1.run-trainer"].map(String::from);
        assert_eq!(pending, want.into());
    }
}
