//! Every container of every kind of run (docs/security.md, "Pods") runs locked down: non-root,
//! no capabilities, no privilege escalation, RuntimeDefault seccomp, a read-only root filesystem
//! (the agent's only when its spec does not say otherwise), and writes only to emptyDirs with a
//! size limit, which is where `HOME`, `/tmp` and every cache point.

mod support;

use k8s_openapi::api::core::v1::{Container, PodSpec};
use moult_operator::api::RLRun;
use moult_operator::children::{desired, quantity, Children, Config, TMP_SIZE};
use support::runs::run_kinds;

fn build(run: &RLRun) -> Children {
    desired(run, &Config::default(), "token").expect("the run builds")
}

/// The pods of a run: component and pod spec.
fn pods(c: Children) -> Vec<(&'static str, PodSpec)> {
    vec![
        ("engine", c.engines.unwrap().spec.template.spec.unwrap()),
        ("trainer", c.trainer.spec.template.spec.unwrap()),
        ("coordinator", c.coordinator.spec.template.spec.unwrap()),
        ("agents", c.agents.spec.template.spec.unwrap()),
    ]
}

fn containers(p: &PodSpec) -> impl Iterator<Item = &Container> {
    p.init_containers.iter().flatten().chain(&p.containers)
}

fn env<'a>(c: &'a Container, name: &str) -> Option<&'a str> {
    c.env
        .iter()
        .flatten()
        .find(|v| v.name == name)
        .and_then(|v| v.value.as_deref())
}

/// The writable mount paths of `c` whose volume is an emptyDir of `p`.
fn writable_dirs<'a>(p: &'a PodSpec, c: &'a Container) -> Vec<&'a str> {
    c.volume_mounts
        .iter()
        .flatten()
        .filter(|m| m.read_only != Some(true))
        .filter(|m| {
            p.volumes
                .iter()
                .flatten()
                .any(|v| v.name == m.name && v.empty_dir.is_some())
        })
        .map(|m| m.mount_path.as_str())
        .collect()
}

#[test]
fn every_container_of_every_kind_of_run_is_locked_down() {
    let kinds = run_kinds();
    assert!(kinds.len() >= 14, "{} kinds", kinds.len());
    for (kind, run) in kinds {
        let writable_agent = !run.spec.agent.read_only_root_filesystem;
        for (component, p) in pods(build(&run)) {
            let what = |c: &Container| format!("{kind}: {component} container {}", c.name);
            let pod = p.security_context.as_ref().expect("a pod security context");
            assert_eq!(pod.run_as_non_root, Some(true), "{kind}: {component}");
            assert_eq!(
                pod.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
                Some("RuntimeDefault")
            );
            for c in containers(&p) {
                let sc = c
                    .security_context
                    .as_ref()
                    .unwrap_or_else(|| panic!("{}", what(c)));
                assert_eq!(sc.allow_privilege_escalation, Some(false), "{}", what(c));
                assert_eq!(sc.run_as_non_root, Some(true), "{}", what(c));
                assert_eq!(sc.privileged, None, "{}", what(c));
                assert_eq!(
                    sc.capabilities.as_ref().and_then(|c| c.drop.clone()),
                    Some(vec!["ALL".to_string()]),
                    "{}",
                    what(c)
                );
                assert!(
                    sc.capabilities.as_ref().unwrap().add.is_none(),
                    "{}",
                    what(c)
                );
                assert_eq!(
                    sc.seccomp_profile.as_ref().map(|s| s.type_.as_str()),
                    Some("RuntimeDefault"),
                    "{}",
                    what(c)
                );
                let agent_code = component == "agents" && c.name == "sandbox";
                assert_eq!(
                    sc.read_only_root_filesystem,
                    Some(!(agent_code && writable_agent)),
                    "{}",
                    what(c)
                );
            }
        }
    }
}

/// Every container has a CPU, a memory and an ephemeral-storage limit, none below its request
/// (docs/operator.md, "Resources"): the spec's own, else the defaults.
#[test]
fn every_container_has_limits_and_none_is_below_its_request() {
    let limit = |run: &RLRun, component: &str, container: &str, key: &str| {
        let (_, p) = pods(build(run))
            .into_iter()
            .find(|(c, _)| *c == component)
            .unwrap();
        let c = containers(&p)
            .find(|c| c.name == container)
            .unwrap()
            .clone();
        c.resources.unwrap().limits.unwrap()[key].0.clone()
    };
    for (kind, run) in run_kinds() {
        for (component, p) in pods(build(&run)) {
            for c in containers(&p) {
                let what = format!("{kind}: {component} container {}", c.name);
                let r = c
                    .resources
                    .as_ref()
                    .unwrap_or_else(|| panic!("{what}: no resources"));
                let limits = r.limits.clone().unwrap_or_default();
                for key in ["cpu", "memory", "ephemeral-storage"] {
                    assert!(limits.contains_key(key), "{what}: no {key} limit");
                }
                for (key, request) in r.requests.iter().flatten() {
                    let l = &limits[key].0;
                    assert!(
                        quantity(l) >= quantity(&request.0) && quantity(l).is_some(),
                        "{what}: the {key} limit {l} is below its request {}",
                        request.0
                    );
                }
            }
        }
    }
    let (_, run) = run_kinds().into_iter().next().unwrap();
    assert_eq!(limit(&run, "agents", "sandbox", "memory"), "8Gi");
    assert_eq!(limit(&run, "coordinator", "coordinator", "cpu"), "4");
    // The spec's own limits stay, and a request above a default raises that limit.
    let mut own = run.clone();
    let quantities = |pairs: &[(&str, &str)]| {
        Some(
            pairs
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        k8s_openapi::apimachinery::pkg::api::resource::Quantity(v.to_string()),
                    )
                })
                .collect(),
        )
    };
    own.spec.agent.resources = Some(k8s_openapi::api::core::v1::ResourceRequirements {
        limits: quantities(&[("memory", "2Gi")]),
        requests: quantities(&[("cpu", "6")]),
        ..Default::default()
    });
    assert_eq!(limit(&own, "agents", "sandbox", "memory"), "2Gi");
    assert_eq!(limit(&own, "agents", "sandbox", "cpu"), "6");
    assert_eq!(limit(&own, "agents", "sandbox", "ephemeral-storage"), "8Gi");
}

#[test]
fn quantities_compare_as_kubernetes_reads_them() {
    let q = |s: &str| quantity(s).unwrap();
    assert_eq!(q("500m"), 0.5);
    assert_eq!(q("16Gi"), 16.0 * 1024.0 * 1024.0 * 1024.0);
    assert_eq!(q("1e3"), 1000.0);
    assert_eq!(q("2E"), 2e18);
    assert_eq!(q("1.5G"), 1.5e9);
    assert!(q("1Gi") > q("1G") && q("1Mi") < q("1G"));
    assert_eq!(quantity("lots"), None);
}

#[test]
fn every_container_writes_only_to_size_limited_emptydirs_where_home_and_caches_point() {
    for (kind, run) in run_kinds() {
        let vllm = run.spec.engines.backend == moult_operator::api::EngineBackend::Vllm;
        for (component, p) in pods(build(&run)) {
            for v in p.volumes.iter().flatten() {
                if let Some(e) = &v.empty_dir {
                    assert!(
                        e.size_limit.is_some(),
                        "{kind}: {component} emptyDir {} has no sizeLimit",
                        v.name
                    );
                }
                assert!(
                    v.host_path.is_none(),
                    "{kind}: {component} mounts a host path"
                );
            }
            for c in containers(&p) {
                let dirs = writable_dirs(&p, c);
                if c.name == "install-moult" {
                    assert_eq!(dirs, ["/opt/moult/bin"], "{kind}: the init container");
                    continue;
                }
                assert!(dirs.contains(&"/tmp"), "{kind}: {component}: {dirs:?}");
                let home = env(c, "HOME").expect("HOME is set");
                assert!(
                    dirs.iter().any(|d| home.starts_with(d)),
                    "{kind}: {component}: HOME {home} is not writable ({dirs:?})"
                );
                if component == "engine" && c.name == "engine" && vllm {
                    for var in [
                        "HF_HOME",
                        "XDG_CACHE_HOME",
                        "XDG_CONFIG_HOME",
                        "VLLM_CACHE_ROOT",
                        "TRITON_CACHE_DIR",
                        "TORCHINDUCTOR_CACHE_DIR",
                        "NUMBA_CACHE_DIR",
                    ] {
                        let path = env(c, var).unwrap_or_else(|| panic!("{kind}: {var} is set"));
                        assert!(path.starts_with("/tmp/"), "{kind}: {var}={path}");
                    }
                }
            }
        }
    }
}

#[test]
fn tmp_is_as_large_as_the_components_ephemeral_storage_limit_or_the_default() {
    let size = |run: &RLRun, component: &str| {
        pods(build(run))
            .into_iter()
            .find(|(c, _)| *c == component)
            .and_then(|(_, p)| {
                p.volumes
                    .into_iter()
                    .flatten()
                    .find(|v| v.name == "tmp")
                    .and_then(|v| v.empty_dir)
                    .and_then(|e| e.size_limit)
            })
            .map(|q| q.0)
            .unwrap()
    };
    let (_, mut run) = run_kinds().remove(0);
    for (component, default) in TMP_SIZE {
        assert_eq!(size(&run, component), default, "{component}");
    }
    let limits = run
        .spec
        .engines
        .resources
        .get_or_insert_with(Default::default)
        .limits
        .get_or_insert_with(Default::default);
    limits.insert(
        "ephemeral-storage".into(),
        k8s_openapi::apimachinery::pkg::api::resource::Quantity("300Gi".into()),
    );
    assert_eq!(size(&run, "engine"), "300Gi");
    assert_eq!(size(&run, "trainer"), "16Gi");
}
