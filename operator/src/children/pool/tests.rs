//! An EnginePool's children, and the children of a run on it (pure builders).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, EnvVar, PodSpec};

use super::*;
use crate::api::RLRun;
use crate::children::tests::pool_example;
use crate::children::{desired, desired_on_pool, Children, RUN_LABEL};

fn pool_children() -> PoolChildren {
    let (pool, _) = pool_example();
    pool_desired(&pool, &Config::default(), "pool-token").expect("the pool builds")
}

fn engine_pod(c: &PoolChildren) -> &PodSpec {
    c.engines.spec.template.spec.as_ref().unwrap()
}

fn env_of<'a>(c: &'a Container, name: &str) -> Option<&'a EnvVar> {
    c.env.iter().flatten().find(|e| e.name == name)
}

/// The Secret and key an environment variable is read from.
fn secret_ref(e: &EnvVar) -> (&str, &str) {
    let r = e
        .value_from
        .as_ref()
        .unwrap()
        .secret_key_ref
        .as_ref()
        .unwrap();
    (r.name.as_str(), r.key.as_str())
}

#[test]
fn a_pools_children_are_owned_by_it_and_labelled_as_its_never_a_runs() {
    let list = pool_children().into_list();
    let names: Vec<(&str, &str)> = list
        .iter()
        .map(|c| (c.object["kind"].as_str().unwrap(), c.name.as_str()))
        .collect();
    assert_eq!(
        names,
        [
            ("Secret", "qwen3-8b-pool"),
            ("NetworkPolicy", "qwen3-8b-engines"),
            ("Service", "qwen3-8b-engines"),
            ("StatefulSet", "qwen3-8b-engines"),
        ]
    );
    for child in &list {
        let meta = &child.object["metadata"];
        let owner = &meta["ownerReferences"][0];
        assert_eq!(owner["kind"], "EnginePool", "{}", child.name);
        assert_eq!(owner["controller"], true);
        assert_eq!(meta["labels"][POOL_LABEL], "qwen3-8b");
        assert_eq!(meta["labels"][MANAGED_BY_LABEL], MANAGED_BY);
        assert!(meta["labels"].get(RUN_LABEL).is_none(), "{}", child.name);
        assert_eq!(meta["namespace"], "research");
    }
    let c = pool_children();
    let data = c.token.data.unwrap();
    assert_eq!(data[TOKEN_KEY].0, b"pool-token");
    assert_eq!(data.len(), 1, "the pool's Secret holds its token alone");
}

#[test]
fn pool_engines_are_built_in_engines_with_the_pools_adapter_flags() {
    let c = pool_children();
    let sts = &c.engines.spec;
    assert_eq!(sts.replicas, Some(2));
    assert_eq!(sts.service_name.as_deref(), Some("qwen3-8b-engines"));
    let selector = sts.selector.match_labels.clone().unwrap();
    assert_eq!(
        selector,
        BTreeMap::from([
            (COMPONENT_LABEL.to_string(), "engine".to_string()),
            (POOL_LABEL.to_string(), "qwen3-8b".to_string()),
        ])
    );
    let pod = engine_pod(&c);
    assert_eq!(pod.containers.len(), 1);
    let engine = &pod.containers[0];
    assert_eq!(engine.command.as_deref(), Some(&["moult".to_string()][..]));
    assert_eq!(
        engine.image.as_deref(),
        Some(Config::default().images.runtime.as_str())
    );
    assert_eq!(
        engine.args.as_deref().unwrap(),
        [
            "engine",
            "--model",
            "/models/Qwen3-8B",
            "--host",
            "0.0.0.0",
            "--port",
            "8000",
            "--served-model-name",
            "qwen3-8b",
            "--max-model-len",
            "8192",
            "--pool-max-adapters",
            "8",
            "--max-lora-rank",
            "64",
        ]
    );
    // The engines check runs' credentials against the pool token; they hold no run config.
    let token = env_of(engine, "MOULT_TOKEN").unwrap();
    assert_eq!(secret_ref(token), ("qwen3-8b-pool", TOKEN_KEY));
    assert!(env_of(engine, "MOULT_CONFIG").is_none());
    let mounts: Vec<&str> = engine
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.as_str())
        .collect();
    assert_eq!(mounts, ["/tmp", "/dev/shm", "/models"]);
    let volumes: Vec<&str> = pod
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(volumes, ["dshm", "model", "tmp"]);
    let claim = pod.volumes.as_ref().unwrap()[1]
        .persistent_volume_claim
        .as_ref()
        .unwrap();
    assert_eq!(
        (claim.claim_name.as_str(), claim.read_only),
        ("models", Some(true))
    );
    // A GPU each, the pool's requests, the probes of every engine, locked down.
    let r = engine.resources.as_ref().unwrap();
    assert_eq!(r.limits.as_ref().unwrap()["nvidia.com/gpu"].0, "1");
    assert_eq!(r.requests.as_ref().unwrap()["memory"].0, "64Gi");
    assert!(engine.readiness_probe.is_some() && engine.startup_probe.is_some());
    let sc = engine.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(pod.automount_service_account_token, Some(false));
    assert_eq!(pod.service_account_name, None);
    let tolerations = pod.tolerations.as_ref().unwrap();
    assert_eq!(tolerations[0].key.as_deref(), Some("nvidia.com/gpu"));
    let labels = c
        .engines
        .spec
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .as_ref()
        .unwrap();
    assert_eq!(
        labels[POOL_UID_LABEL],
        "7c1d2e3f-0000-4000-8000-000000000000"
    );
    // The headless Service in front of them is what runs are told.
    let svc = c.service.spec.as_ref().unwrap();
    assert_eq!(svc.cluster_ip.as_deref(), Some("None"));
    assert_eq!(svc.selector.as_ref(), Some(&selector));
}

#[test]
fn pool_engines_restart_for_a_spec_change_not_for_a_scale() {
    let (pool, _) = pool_example();
    let hash = |p: &crate::api::EnginePool| {
        let c = pool_desired(p, &Config::default(), "t").unwrap();
        let meta = c.engines.spec.template.metadata.unwrap();
        meta.annotations.unwrap()[super::super::CONFIG_HASH_ANNOTATION].clone()
    };
    let mut scaled = pool.clone();
    scaled.spec.engines.replicas = 7;
    assert_eq!(hash(&pool), hash(&scaled));
    let mut more = pool.clone();
    more.spec.max_adapters = 16;
    assert_ne!(hash(&pool), hash(&more));
}

#[test]
fn a_pool_that_asks_for_vllm_is_not_built() {
    // The CRD refuses it; a pool stored before that rule still gets a reason, not vLLM pods.
    let (mut pool, _) = pool_example();
    pool.spec.engines.backend = crate::api::EngineBackend::Vllm;
    let err = pool_desired(&pool, &Config::default(), "t").unwrap_err();
    assert!(err.0.starts_with("spec.engines.backend"), "{err}");
}

#[test]
fn only_the_pools_runs_the_operator_and_scrapers_reach_its_engines() {
    let policy = pool_children().network_policy.spec.unwrap();
    assert_eq!(
        policy.pod_selector.unwrap().match_labels.unwrap()[POOL_LABEL],
        "qwen3-8b"
    );
    assert_eq!(policy.policy_types.unwrap(), ["Ingress"]);
    let ingress = policy.ingress.unwrap();
    assert_eq!(ingress.len(), 1);
    let from = ingress[0].from.as_ref().unwrap();
    assert_eq!(
        from[0].pod_selector.as_ref().unwrap().match_labels,
        Some(BTreeMap::from([(
            ON_POOL_LABEL.to_string(),
            "qwen3-8b".to_string()
        )]))
    );
    let ports = ingress[0].ports.as_ref().unwrap();
    assert_eq!(ports[0].port, Some(IntOrString::Int(ENGINE_PORT)));

    let (pool, _) = pool_example();
    let scraper = NetworkPolicyPeer {
        namespace_selector: Some(LabelSelector::default()),
        ..NetworkPolicyPeer::default()
    };
    let config = Config {
        metrics_from: vec![scraper.clone()],
        ..Config::default()
    };
    let scraped = pool_desired(&pool, &config, "t").unwrap().network_policy;
    let ingress = scraped.spec.unwrap().ingress.unwrap();
    assert_eq!(ingress[1].from.as_deref(), Some(&[scraper][..]));

    // The operator, where it runs.
    let config = Config {
        operator: Some(crate::children::operator_pods("moult-system")),
        ..Config::default()
    };
    let policy = pool_desired(&pool, &config, "t").unwrap().network_policy;
    let from = policy.spec.unwrap().ingress.unwrap()[0]
        .from
        .clone()
        .unwrap();
    assert_eq!(from.len(), 2);
    let operator = &from[1];
    assert_eq!(
        operator.namespace_selector.as_ref().unwrap().match_labels,
        Some(BTreeMap::from([(
            "kubernetes.io/metadata.name".to_string(),
            "moult-system".to_string()
        )]))
    );
    assert_eq!(
        operator.pod_selector.as_ref().unwrap().match_labels,
        Some(BTreeMap::from([(
            "app.kubernetes.io/name".to_string(),
            "moult-operator".to_string()
        )]))
    );
}

/// A run of the example on its pool, whose token is `pool-token`.
fn on_pool(run: &RLRun) -> (OnPool, Children) {
    let (pool, _) = pool_example();
    let on = OnPool::new(&pool, "pool-token", run.metadata.name.as_deref().unwrap());
    let c = desired_on_pool(run, &Config::default(), "run-token", &on).expect("the run builds");
    (on, c)
}

#[test]
fn a_run_on_a_pool_has_no_engines_and_holds_its_own_credential() {
    let (_, runs) = pool_example();
    let run = &runs[0];
    let (on, c) = on_pool(run);
    assert!(c.engines.is_none() && c.engine_service.is_none());
    assert!(c.network_policies.engine.is_none());
    let list = c.clone().into_list();
    assert!(
        list.iter().all(|c| !c.name.ends_with("-engine")),
        "{:?}",
        list.iter().map(|c| &c.name).collect::<Vec<_>>()
    );
    let data = c.token.data.clone().unwrap();
    let credential = String::from_utf8(data[POOL_CREDENTIAL_KEY].0.clone()).unwrap();
    assert_eq!(credential, on.credential);
    assert_eq!(
        crate::credentials::pool_run("pool-token", &credential),
        Some("gsm8k-lora-a")
    );
    assert!(
        data.values().all(|v| v.0 != b"pool-token"),
        "the run never holds the pool token"
    );
}

#[test]
fn a_runs_coordinator_and_trainer_get_the_pool_and_its_agents_do_not() {
    let (_, runs) = pool_example();
    let (_, c) = on_pool(&runs[0]);
    let coordinator = c.coordinator.spec.template.clone();
    let trainer = c.trainer.spec.template.clone();
    for (role, t) in [("coordinator", &coordinator), ("trainer", &trainer)] {
        let container = &t.spec.as_ref().unwrap().containers[0];
        let credential = env_of(container, POOL_CREDENTIAL_ENV).unwrap();
        assert_eq!(
            secret_ref(credential),
            ("gsm8k-lora-a-token", POOL_CREDENTIAL_KEY),
            "{role}"
        );
        let labels = t.metadata.as_ref().unwrap().labels.as_ref().unwrap();
        assert_eq!(labels[ON_POOL_LABEL], "qwen3-8b", "{role}");
    }
    let coordinator = &coordinator.spec.unwrap().containers[0];
    let engines = env_of(coordinator, "MOULT_ENGINES").unwrap();
    assert_eq!(engines.value.as_deref(), Some("qwen3-8b-engines"));
    let agents = c.agents.spec.template.clone();
    for container in &agents.spec.as_ref().unwrap().containers {
        assert!(env_of(container, POOL_CREDENTIAL_ENV).is_none());
    }
    let labels = agents.metadata.unwrap().labels.unwrap();
    assert!(
        !labels.contains_key(ON_POOL_LABEL),
        "agents never reach the pool"
    );
}

#[test]
fn no_engine_reaches_the_trainer_of_a_run_on_a_pool() {
    // The adapter goes up through the run's coordinator; the trainer admits its own ranks and
    // metrics scrapes only.
    let (_, runs) = pool_example();
    let (_, c) = on_pool(&runs[0]);
    let trainer = c.network_policies.trainer.spec.unwrap().ingress.unwrap();
    assert_eq!(trainer.len(), 2, "{trainer:?}");
    let weight_stream = IntOrString::Int(crate::children::WEIGHT_STREAM_PORT);
    assert!(!trainer
        .iter()
        .flat_map(|r| r.ports.iter().flatten())
        .any(|p| p.port == Some(weight_stream.clone())));
}

#[test]
fn a_runs_pods_may_read_its_pool_and_no_other() {
    let (_, runs) = pool_example();
    let (_, c) = on_pool(&runs[0]);
    let rules = c.role.rules.unwrap();
    let pools: Vec<_> = rules
        .iter()
        .filter(|r| r.resources.iter().flatten().any(|x| x == "enginepools"))
        .collect();
    assert_eq!(pools.len(), 1);
    assert_eq!(
        pools[0].resource_names.as_deref(),
        Some(&["qwen3-8b".to_string()][..])
    );
    assert_eq!(pools[0].verbs, ["get", "watch"]);
    // A run with engines of its own reads no pool.
    let own = desired(
        &crate::children::tests::example_run(),
        &Config::default(),
        "t",
    )
    .unwrap();
    assert!(!own.role.rules.unwrap().iter().any(|r| r
        .resources
        .iter()
        .flatten()
        .any(|x| x == "enginepools")));
}

#[test]
fn a_run_naming_a_pool_is_not_built_without_it() {
    let (_, runs) = pool_example();
    let err = desired(&runs[0], &Config::default(), "t").unwrap_err();
    assert!(err.0.contains("spec.engines.poolRef"), "{err}");
}

#[test]
fn a_queued_run_on_a_pool_queues_no_engines() {
    let (_, runs) = pool_example();
    let mut run = runs[0].clone();
    run.spec.scheduling.queue_name = Some("team-a".into());
    let (_, c) = on_pool(&run);
    let w = c.workload.expect("a Workload");
    let sets: Vec<&str> = w["spec"]["podSets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(sets, ["trainer", "coordinator", "agents"]);
}
