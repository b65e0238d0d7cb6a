use k8s_openapi::api::core::v1::{Container, PodSpec, Toleration};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::*;
use crate::api::{EngineBackend, RLRun};

/// The RLRun of the cluster example, as the API server would hand it over.
pub(crate) fn example_run() -> RLRun {
    run_of(include_str!("../../../examples/cluster/gsm8k-grpo.yaml"))
}

/// The RLRun of a manifest's documents, as the API server would hand it over.
fn run_of(text: &str) -> RLRun {
    let doc = text
        .split("\n---\n")
        .find(|d| d.contains("kind: RLRun"))
        .expect("the example has an RLRun");
    let mut run: RLRun = serde_yaml_ng::from_str(doc).expect("the example parses");
    run.metadata.namespace = Some("research".into());
    run.metadata.uid = Some("0b1c6a52-5d1e-4f2a-9a55-7f3a1f6c1e01".into());
    run
}

fn build(run: &RLRun) -> Children {
    desired(run, &Config::default(), "secret-token").expect("the example builds")
}

fn pod(spec: &Option<k8s_openapi::api::core::v1::PodTemplateSpec>) -> &PodSpec {
    spec.as_ref()
        .and_then(|t| t.spec.as_ref())
        .expect("a pod spec")
}

fn main_container(p: &PodSpec) -> &Container {
    &p.containers[0]
}

fn args(c: &Container) -> Vec<&str> {
    c.args.iter().flatten().map(String::as_str).collect()
}

#[test]
fn every_child_is_owned_by_the_run_as_controller_and_labelled() {
    let run = example_run();
    let list = build(&run).into_list();
    assert_eq!(list.len(), 16);
    for child in &list {
        let meta = &child.object["metadata"];
        let owner = &meta["ownerReferences"][0];
        assert_eq!(owner["kind"], "RLRun", "{}", child.name);
        assert_eq!(owner["uid"], "0b1c6a52-5d1e-4f2a-9a55-7f3a1f6c1e01");
        assert_eq!(owner["controller"], true);
        assert_eq!(meta["labels"][RUN_LABEL], "gsm8k-grpo");
        assert_eq!(meta["labels"][MANAGED_BY_LABEL], MANAGED_BY);
        assert_eq!(meta["namespace"], "research");
        assert!(child.object["apiVersion"].is_string() && child.object["kind"].is_string());
    }
    let names: std::collections::BTreeSet<_> = list
        .iter()
        .map(|c| (c.object["kind"].as_str().unwrap(), c.name.as_str()))
        .collect();
    assert_eq!(
        names.len(),
        16,
        "no two children share a kind and name: {names:?}"
    );
}

#[test]
fn vllm_engines_get_the_flags_and_gpus_moult_needs() {
    let c = build(&example_run());
    let sts = &c.engines.clone().unwrap().spec;
    assert_eq!(sts.replicas, Some(4));
    assert_eq!(sts.pod_management_policy.as_deref(), Some("Parallel"));
    let p = pod(&Some(sts.template.clone())).clone();
    let e = main_container(&p);
    assert_eq!(e.image.as_deref(), Some("vllm/vllm-openai:v0.32.0"));
    assert_eq!(
        e.command.as_deref(),
        Some(&["vllm".to_string(), "serve".to_string()][..])
    );
    let a = args(e);
    assert_eq!(a[0], "/models/Qwen3-8B");
    let flag = |name: &str| a.iter().position(|x| *x == name).map(|i| a[i + 1]);
    assert_eq!(flag("--logprobs-mode"), Some("processed_logprobs"));
    assert_eq!(flag("--tensor-parallel-size"), Some("2"));
    assert_eq!(flag("--max-model-len"), Some("8192"));
    // vLLM checks no credential: it listens on the pod's loopback, and the pod's port is the
    // front's, which checks the run token (and has no GPU).
    assert_eq!(flag("--host"), Some("127.0.0.1"));
    assert_eq!(flag("--port"), Some("8001"));
    assert_eq!(e.ports, None, "vLLM's port is not the pod's");
    let front = &p.containers[1];
    assert_eq!(front.name, "engine-front");
    assert_eq!(
        args(front),
        [
            "engine-front",
            "--upstream",
            "http://127.0.0.1:8001",
            "--host",
            "0.0.0.0",
            "--port",
            "8000"
        ]
    );
    assert_eq!(front.ports.as_ref().unwrap()[0].container_port, 8000);
    let front_env = front.env.as_ref().unwrap();
    assert!(front_env.iter().any(|v| v.name == "MOULT_TOKEN"));
    let front_limits = front.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert!(!front_limits.contains_key("nvidia.com/gpu"));
    assert_eq!(front_limits["memory"].0, "1Gi");
    let probe = e
        .readiness_probe
        .as_ref()
        .unwrap()
        .http_get
        .as_ref()
        .unwrap();
    assert_eq!(
        probe.port,
        IntOrString::Int(8000),
        "probes reach vLLM through the front"
    );
    let env = e.env.as_ref().unwrap();
    assert!(env
        .iter()
        .any(|v| v.name == "VLLM_SERVER_DEV_MODE" && v.value.as_deref() == Some("1")));
    assert!(
        !env.iter().any(|v| v.name.contains("TOKEN")),
        "vLLM holds no credential"
    );
    let limits = e.resources.as_ref().unwrap().limits.as_ref().unwrap();
    assert_eq!(limits["nvidia.com/gpu"].0, "2");
    assert_eq!(
        e.resources.as_ref().unwrap().requests.as_ref().unwrap()["nvidia.com/gpu"].0,
        "2"
    );
    assert_eq!(
        p.node_selector.as_ref().unwrap()["nvidia.com/gpu.product"],
        "NVIDIA-H100-80GB-HBM3"
    );
    assert!(p
        .tolerations
        .as_ref()
        .unwrap()
        .iter()
        .any(|t| t.key.as_deref() == Some("nvidia.com/gpu")));
}

#[test]
fn routing_replay_asks_vllm_for_routed_experts() {
    let mut run = example_run();
    assert!(!args(main_container(pod(&Some(
        build(&run).engines.clone().unwrap().spec.template
    ))))
    .contains(&"--enable-return-routed-experts"));
    run.spec.routing_replay = true;
    assert!(args(main_container(pod(&Some(
        build(&run).engines.clone().unwrap().spec.template
    ))))
    .contains(&"--enable-return-routed-experts"));
}

/// A LoRA run's engines get the adapter's shape (`moult engine --lora`, docs/lora.md), as
/// the runtime's `LoraConfig` reads it; a served teacher's engines do not.
#[test]
fn a_lora_runs_builtin_engines_serve_its_adapter() {
    let mut run = example_run();
    run.spec.engines.backend = EngineBackend::Builtin;
    run.spec.engines.tensor_parallel_size = 1;
    run.spec.model.lora = Some(serde_json::from_value(serde_json::json!({"rank": 8})).unwrap());
    let c = build(&run);
    let p = pod(&Some(c.engines.clone().unwrap().spec.template)).clone();
    let a = args(main_container(&p));
    let at = a.iter().position(|x| *x == "--lora").expect("--lora");
    let value: serde_json::Value = serde_json::from_str(a[at + 1]).unwrap();
    assert_eq!(
        value,
        serde_json::json!({"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets":
            ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})
    );
}

#[test]
fn the_builtin_engine_runs_moult_engine_without_gpus() {
    let mut run = example_run();
    run.spec.engines.backend = EngineBackend::Builtin;
    run.spec.engines.tensor_parallel_size = 1;
    run.spec.engines.gpus_per_engine = Some(0);
    let c = build(&run);
    let p = pod(&Some(c.engines.clone().unwrap().spec.template)).clone();
    let e = main_container(&p);
    assert_eq!(e.command.as_deref(), Some(&["moult".to_string()][..]));
    assert_eq!(args(e)[..3], ["engine", "--model", "/models/Qwen3-8B"]);
    assert!(
        args(e).contains(&"0.0.0.0"),
        "the engine must listen beyond loopback: {:?}",
        args(e)
    );
    assert!(e
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .is_none_or(|l| !l.contains_key("nvidia.com/gpu")));
    assert!(p.node_selector.is_none(), "CPU engines may run on any node");
    assert!(!e
        .env
        .as_ref()
        .unwrap()
        .iter()
        .any(|v| v.name == "VLLM_SERVER_DEV_MODE"));
}

#[test]
fn trainer_ranks_find_rank_zero_through_the_headless_service() {
    let c = build(&example_run());
    assert_eq!(
        c.trainer_service
            .spec
            .as_ref()
            .unwrap()
            .cluster_ip
            .as_deref(),
        Some("None")
    );
    let sts = c.trainer.spec;
    assert_eq!(sts.service_name.as_deref(), Some("gsm8k-grpo-trainer"));
    let p = pod(&Some(sts.template)).clone();
    let env = main_container(&p).env.clone().unwrap();
    let get = |n: &str| env.iter().find(|v| v.name == n).cloned().unwrap();
    assert_eq!(
        get("MASTER_ADDR").value.as_deref(),
        Some("gsm8k-grpo-trainer-0.gsm8k-grpo-trainer.research.svc")
    );
    assert_eq!(get("WORLD_SIZE").value.as_deref(), Some("1"));
    assert!(get("RANK")
        .value_from
        .unwrap()
        .field_ref
        .unwrap()
        .field_path
        .contains("pod-index"));
    assert_eq!(
        main_container(&p)
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap()["nvidia.com/gpu"]
            .0,
        "8"
    );
    assert!(p.volumes.unwrap().iter().any(|v| v
        .persistent_volume_claim
        .as_ref()
        .is_some_and(|c| c.claim_name == "checkpoints")));
}

#[test]
fn the_trainer_mounts_the_teacher_of_distillation() {
    let mut run = example_run();
    run.spec.algorithm.estimator = crate::api::Estimator::OnPolicyDistillation;
    run.spec.algorithm.teacher = Some(crate::api::TeacherSpec {
        path: "Qwen3-32B".into(),
        claim_name: Some("teachers".into()),
        replicas: None,
    });
    let c = build(&run);
    let template = Some(c.trainer.spec.template);
    let p = pod(&template);
    let env = main_container(p).env.clone().unwrap();
    let teacher = env.iter().find(|e| e.name == "MOULT_TEACHER").unwrap();
    assert_eq!(teacher.value.as_deref(), Some("/teacher/Qwen3-32B"));
    assert!(p.volumes.as_ref().unwrap().iter().any(|v| v
        .persistent_volume_claim
        .as_ref()
        .is_some_and(|c| c.claim_name == "teachers" && c.read_only == Some(true))));
    assert!(main_container(p)
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .any(|m| m.mount_path == "/teacher"));
    // Without distillation there is no teacher anywhere.
    let plain = Some(build(&example_run()).trainer.spec.template);
    let env = main_container(pod(&plain)).env.clone().unwrap();
    assert!(!env.iter().any(|e| e.name == "MOULT_TEACHER"));
}

#[test]
fn the_coordinator_reads_the_held_out_tasks_from_their_claim() {
    // The example evaluates on the dataset claim of its training tasks: mounted once, at /data.
    let c = build(&example_run());
    let template = Some(c.coordinator.spec.template);
    let p = pod(&template);
    let env = main_container(p).env.clone().unwrap();
    let tasks = |name: &str| env.iter().find(|e| e.name == name).unwrap().value.clone();
    assert_eq!(
        tasks("MOULT_TASKS").as_deref(),
        Some("/data/gsm8k/main/train-*.parquet")
    );
    assert_eq!(
        tasks("MOULT_EVAL_TASKS").as_deref(),
        Some("/data/gsm8k/main/test-*.parquet")
    );
    let claims: Vec<_> = p
        .volumes
        .iter()
        .flatten()
        .filter_map(|v| v.persistent_volume_claim.as_ref())
        .map(|c| c.claim_name.as_str())
        .collect();
    assert_eq!(claims, ["datasets"]);
    // Held-out tasks on a claim of their own are mounted apart, read-only.
    let mut run = example_run();
    let eval = run.spec.eval.as_mut().unwrap();
    eval.dataset.claim_name = Some("held-out".into());
    eval.dataset.path = "/gsm8k/test.jsonl".into();
    let c = build(&run);
    let template = Some(c.coordinator.spec.template);
    let p = pod(&template);
    let env = main_container(p).env.clone().unwrap();
    let path = env.iter().find(|e| e.name == "MOULT_EVAL_TASKS").unwrap();
    assert_eq!(path.value.as_deref(), Some("/eval-data/gsm8k/test.jsonl"));
    assert!(p.volumes.as_ref().unwrap().iter().any(|v| v
        .persistent_volume_claim
        .as_ref()
        .is_some_and(|c| c.claim_name == "held-out" && c.read_only == Some(true))));
    assert!(main_container(p)
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .any(|m| m.mount_path == "/eval-data" && m.read_only == Some(true)));
    // Without spec.eval, no held-out tasks.
    let mut run = example_run();
    run.spec.eval = None;
    let c = build(&run);
    let template = Some(c.coordinator.spec.template);
    let env = main_container(pod(&template)).env.clone().unwrap();
    assert!(!env.iter().any(|e| e.name == "MOULT_EVAL_TASKS"));
}

#[test]
fn trainer_ranks_are_one_pod_per_node_told_the_world_of_nodes() {
    // GPU ranks: two pods of gpusPerNode GPUs each; each pod's `moult trainer` starts its
    // node's ranks (docs/distributed.md), so WORLD_SIZE counts pods, as torchrun's does nodes.
    let mut run = example_run();
    let gpus = run.spec.trainer.gpus_per_node;
    assert!(gpus > 0);
    run.spec.trainer.nodes = 2;
    for gpus in [gpus, 0] {
        run.spec.trainer.gpus_per_node = gpus;
        let Ok(children) = desired(&run, &Config::default(), "t") else {
            panic!("two trainer nodes with {gpus} GPUs each were refused");
        };
        let sts = children.trainer.spec;
        assert_eq!(sts.replicas, Some(2));
        let container = main_container(&pod(&Some(sts.template)).clone()).clone();
        let env = container.env.clone().unwrap();
        let world = env.iter().find(|v| v.name == "WORLD_SIZE").unwrap();
        assert_eq!(world.value.as_deref(), Some("2"));
        let limits = container
            .resources
            .and_then(|r| r.limits)
            .unwrap_or_default();
        let requested = limits.get("nvidia.com/gpu").map(|q| q.0.clone());
        if gpus > 0 {
            assert_eq!(
                requested,
                Some(gpus.to_string()),
                "a pod gets its node's GPUs"
            );
        } else {
            assert_eq!(requested, None);
        }
    }
}

#[test]
fn a_judge_run_gets_judge_engines_that_only_the_coordinator_reaches() {
    let mut run = example_run();
    run.spec.judge = Some(
        serde_json::from_value(serde_json::json!({
            "path": "Qwen3-32B", "claimName": "models", "replicas": 2,
            "prompt": "Is {response} right? Answer yes or no."
        }))
        .unwrap(),
    );
    let c = build(&run);
    // The judge's engines: the engine pool's pods (vLLM) on the judge model, no weight updates.
    let judge = c.judge.clone().expect("judge engines");
    assert_eq!(judge.metadata.name.as_deref(), Some("gsm8k-grpo-judge"));
    assert_eq!(judge.spec.replicas, Some(2));
    let template = Some(judge.spec.template.clone());
    let p = pod(&template);
    let a = args(main_container(p));
    assert_eq!(a[0], "/judge/Qwen3-32B", "{a:?}");
    assert!(!a.contains(&"--weight-transfer-config"), "{a:?}");
    let labels = p_labels(&template);
    assert_eq!(
        labels.get("moult.dev/component").map(String::as_str),
        Some("judge")
    );
    assert!(c.judge_service.is_some());
    // Only the coordinator may connect to them.
    let policy = c.network_policies.judge.clone().expect("a judge policy");
    let rules = policy.spec.unwrap().ingress.unwrap();
    let from = serde_json::to_string(&rules[0].from).unwrap();
    assert!(
        from.contains("coordinator") && rules.len() == 1,
        "{rules:?}"
    );
    // The coordinator asks them (the Service's EndpointSlices), with the judge's tokenizer from
    // the model claim it shares with the policy, whose tokenizer reads the replies.
    let template = Some(c.coordinator.spec.template.clone());
    let env = main_container(pod(&template)).env.clone().unwrap();
    let var = |name: &str| {
        env.iter()
            .find(|e| e.name == name)
            .and_then(|e| e.value.clone())
    };
    assert_eq!(
        var("MOULT_JUDGE_ENGINES").as_deref(),
        Some("gsm8k-grpo-judge")
    );
    assert_eq!(
        var("MOULT_JUDGE_MODEL").as_deref(),
        Some("/models/Qwen3-32B")
    );
    assert_eq!(var("MOULT_MODEL").as_deref(), Some("/models/Qwen3-8B"));
    // Listed with the other children, in apply order; none without a judge.
    let list = c.into_list();
    assert!(list
        .iter()
        .any(|x| x.name == "gsm8k-grpo-judge" && x.kind == ChildKind::StatefulSet));
    assert!(list.windows(2).all(|w| w[0].kind <= w[1].kind));
    let plain = build(&example_run());
    assert!(plain.judge.is_none() && plain.judge_service.is_none());
    assert!(plain.network_policies.judge.is_none());
}

#[test]
fn a_served_teacher_gets_engines_of_its_own_and_the_trainer_no_teacher() {
    let mut run = example_run();
    run.spec.model.max_model_len = Some(4096);
    run.spec.routing_replay = true;
    run.spec.algorithm.estimator = crate::api::Estimator::OnPolicyDistillation;
    run.spec.algorithm.teacher = Some(crate::api::TeacherSpec {
        path: "Qwen3-32B".into(),
        claim_name: Some("teachers".into()),
        replicas: Some(3),
    });
    let c = build(&run);
    // The teacher's engines: vLLM on the teacher model, no weight updates nor routed experts,
    // one token more context than the policy's (a whole segment is their prompt).
    let teacher = c.teacher.clone().expect("teacher engines");
    assert_eq!(teacher.metadata.name.as_deref(), Some("gsm8k-grpo-teacher"));
    assert_eq!(teacher.spec.replicas, Some(3));
    let template = Some(teacher.spec.template.clone());
    let p = pod(&template);
    let a = args(main_container(p));
    assert_eq!(a[0], "/teacher/Qwen3-32B", "{a:?}");
    assert!(!a.contains(&"--weight-transfer-config"), "{a:?}");
    assert!(!a.contains(&"--enable-return-routed-experts"), "{a:?}");
    let len = a.iter().position(|&x| x == "--max-model-len").unwrap();
    assert_eq!(a[len + 1], "4097");
    assert!(p.volumes.as_ref().unwrap().iter().any(|v| v
        .persistent_volume_claim
        .as_ref()
        .is_some_and(|c| c.claim_name == "teachers" && c.read_only == Some(true))));
    assert_eq!(
        p_labels(&template)
            .get("moult.dev/component")
            .map(String::as_str),
        Some("teacher")
    );
    assert!(c.teacher_service.is_some());
    // Only the coordinator may connect to them; it finds them through their Service.
    let policy = c
        .network_policies
        .teacher
        .clone()
        .expect("a teacher policy");
    let rules = policy.spec.unwrap().ingress.unwrap();
    let from = serde_json::to_string(&rules[0].from).unwrap();
    assert!(
        from.contains("coordinator") && rules.len() == 1,
        "{rules:?}"
    );
    let template = Some(c.coordinator.spec.template.clone());
    let env = main_container(pod(&template)).env.clone().unwrap();
    assert!(env
        .iter()
        .any(|e| e.name == "MOULT_TEACHER_ENGINES"
            && e.value.as_deref() == Some("gsm8k-grpo-teacher")));
    // The trainer neither loads nor mounts it.
    let template = Some(c.trainer.spec.template.clone());
    let p = pod(&template);
    assert!(!main_container(p)
        .env
        .as_ref()
        .unwrap()
        .iter()
        .any(|e| e.name == "MOULT_TEACHER"));
    assert!(!p.volumes.as_ref().unwrap().iter().any(|v| v
        .persistent_volume_claim
        .as_ref()
        .is_some_and(|c| c.claim_name == "teachers")));
    let list = c.into_list();
    assert!(list
        .iter()
        .any(|x| x.name == "gsm8k-grpo-teacher" && x.kind == ChildKind::StatefulSet));
    // The policy's engines keep their flags.
    let engines = Some(build(&run).engines.clone().unwrap().spec.template);
    let a = args(main_container(pod(&engines)));
    assert!(a.contains(&"--enable-return-routed-experts"), "{a:?}");
    let len = a.iter().position(|&x| x == "--max-model-len").unwrap();
    assert_eq!(a[len + 1], "4096");
    // Not served: no teacher engines.
    run.spec.algorithm.teacher.as_mut().unwrap().replicas = None;
    let c = build(&run);
    assert!(c.teacher.is_none() && c.teacher_service.is_none());
    assert!(c.network_policies.teacher.is_none());
}

fn p_labels(
    t: &Option<k8s_openapi::api::core::v1::PodTemplateSpec>,
) -> std::collections::BTreeMap<String, String> {
    t.as_ref()
        .and_then(|t| t.metadata.as_ref())
        .and_then(|m| m.labels.clone())
        .unwrap_or_default()
}

#[test]
fn every_pod_runs_as_the_runs_own_service_account_which_is_never_the_namespaces_default() {
    let c = build(&example_run());
    assert_eq!(
        c.service_account.metadata.name.as_deref(),
        Some("gsm8k-grpo-moult")
    );
    assert_eq!(c.role.metadata.name.as_deref(), Some("gsm8k-grpo-moult"));
    let binding = &c.role_binding;
    assert_eq!(binding.role_ref.name, "gsm8k-grpo-moult");
    assert_eq!(
        binding.subjects.as_ref().unwrap()[0].name,
        "gsm8k-grpo-moult"
    );
    for t in [
        c.engines.clone().unwrap().spec.template,
        c.trainer.spec.template,
        c.coordinator.spec.template,
        c.agents.spec.template,
    ] {
        let p = t.spec.unwrap();
        assert_eq!(p.service_account_name.as_deref(), Some("gsm8k-grpo-moult"));
    }
    let mut default = example_run();
    default.metadata.name = Some("default".into());
    let c = build(&default);
    for child in c.into_list() {
        assert_ne!(
            child.name, "default",
            "an RLRun named default names no {:?} default",
            child.kind
        );
    }
}

/// The key of the token Secret that `variable` of `c` is read from, if any.
fn secret_key(c: &k8s_openapi::api::core::v1::Container, variable: &str) -> Option<String> {
    let v = c.env.iter().flatten().find(|v| v.name == variable)?;
    let selector = v.value_from.as_ref()?.secret_key_ref.as_ref()?;
    assert_eq!(selector.name, "gsm8k-grpo-token");
    Some(selector.key.clone())
}

#[test]
fn agent_pods_hold_the_agent_credential_alone_and_no_api_credential() {
    let c = build(&example_run());
    let secret = c.token.data.as_ref().unwrap();
    assert_eq!(secret["token"].0, b"secret-token");
    assert_eq!(
        secret["agent-token"].0,
        crate::credentials::agent_credential("secret-token").into_bytes()
    );
    for (component, t) in [
        ("engines", c.engines.clone().unwrap().spec.template),
        ("trainer", c.trainer.spec.template),
        ("coordinator", c.coordinator.spec.template),
        ("agents", c.agents.spec.template),
    ] {
        let p = t.spec.unwrap();
        // A vLLM pod's run token is its front's.
        let main = (p.containers.iter())
            .find(|c| c.name == "engine-front")
            .unwrap_or(&p.containers[0]);
        let (run, agent) = (
            secret_key(main, "MOULT_TOKEN"),
            secret_key(main, "MOULT_AGENT_TOKEN"),
        );
        if component == "agents" {
            assert_eq!((run, agent.as_deref()), (None, Some("agent-token")));
            for init in p.init_containers.iter().flatten() {
                assert!(init.env.iter().flatten().all(|v| v.value_from.is_none()));
            }
        } else {
            assert_eq!(
                (run.as_deref(), agent),
                (Some("token"), None),
                "{component}"
            );
        }
        assert_eq!(
            p.automount_service_account_token,
            Some(component == "coordinator"),
            "{component}: only the coordinator calls the API server"
        );
    }
}

#[test]
fn agents_run_the_injected_moult_binary_in_the_users_image() {
    let mut run = example_run();
    run.spec.agent.form = crate::api::AgentForm::ChatAgent;
    run.spec.agent.image = Some("python:3.12-slim".into());
    run.spec.agent.command = vec!["python".into(), "agent.py".into()];
    let p = build(&run).agents.spec.template.spec.unwrap();
    let a = &p.containers[0];
    assert_eq!(a.image.as_deref(), Some("python:3.12-slim"));
    assert_eq!(
        a.command.as_deref(),
        Some(&["/opt/moult/bin/moult".to_string()][..])
    );
    assert_eq!(args(a)[args(a).len() - 3..], ["--", "python", "agent.py"]);
    // Agent code runs in the second container, of the same image, beside no credential.
    let sandbox = &p.containers[1];
    assert_eq!(sandbox.name, "sandbox");
    assert_eq!(sandbox.image, a.image);
    assert_eq!(
        args(sandbox),
        ["sandbox", "--socket", crate::children::SANDBOX_SOCKET]
    );
    let names: Vec<&str> = sandbox
        .env
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(names, ["HOME"], "no credential, no config");
    let mounts: Vec<&str> = sandbox
        .volume_mounts
        .iter()
        .flatten()
        .map(|m| m.mount_path.as_str())
        .collect();
    assert_eq!(mounts, ["/tmp", "/opt/moult/bin"]);
    // The agent's resources are the sandbox's, with default limits where they set none
    // (docs/operator.md, "Resources").
    let (own, got) = (
        run.spec.agent.resources.clone().unwrap_or_default(),
        sandbox.resources.clone().unwrap(),
    );
    let requests = got.requests.unwrap();
    for (key, value) in own.requests.iter().flatten() {
        assert_eq!(requests.get(key), Some(value), "{key}");
    }
    let limits = got.limits.unwrap();
    for (key, value) in own.limits.iter().flatten() {
        assert_eq!(limits.get(key), Some(value), "{key}");
    }
    assert!(["cpu", "memory", "ephemeral-storage"]
        .iter()
        .all(|k| limits.contains_key(*k)));
    let sandbox_env = a
        .env
        .iter()
        .flatten()
        .find(|v| v.name == "MOULT_AGENT_SANDBOX");
    assert_eq!(
        sandbox_env.and_then(|v| v.value.as_deref()),
        Some(crate::children::SANDBOX_SOCKET)
    );
    let init = &p.init_containers.as_ref().unwrap()[0];
    assert!(init.image.as_deref().unwrap().contains("moult-init"));
    assert!(init
        .volume_mounts
        .as_ref()
        .unwrap()
        .iter()
        .any(|m| m.mount_path == "/opt/moult/bin"));
}

#[test]
fn suspend_scales_every_workload_to_zero_and_keeps_the_rest() {
    let mut run = example_run();
    let running = build(&run);
    run.spec.suspend = true;
    let suspended = build(&run);
    assert_eq!(suspended.engines.clone().unwrap().spec.replicas, Some(0));
    assert_eq!(suspended.trainer.spec.replicas, Some(0));
    assert_eq!(suspended.coordinator.spec.replicas, Some(0));
    assert_eq!(suspended.agents.spec.replicas, Some(0));
    assert_eq!(suspended.config, {
        let mut c = running.config.clone();
        c.data.as_mut().unwrap().insert(
            "rlrun.yaml".into(),
            suspended.config.data.as_ref().unwrap()["rlrun.yaml"].clone(),
        );
        c
    });
    assert_eq!(suspended.token, running.token);
}

#[test]
fn scaling_engines_does_not_restart_pods_but_changing_the_algorithm_does() {
    let mut run = example_run();
    let hash = |c: &Children| {
        c.engines
            .as_ref()
            .unwrap()
            .spec
            .template
            .metadata
            .as_ref()
            .unwrap()
            .annotations
            .as_ref()
            .unwrap()[CONFIG_HASH_ANNOTATION]
            .clone()
    };
    let before = hash(&build(&run));
    run.spec.engines.replicas = 7;
    run.spec.suspend = true;
    assert_eq!(hash(&build(&run)), before);
    run.spec.algorithm.group_size = 16;
    assert_ne!(hash(&build(&run)), before);
}

#[test]
fn the_config_map_holds_the_run_manifest() {
    let run = example_run();
    let cm = build(&run).config;
    let back: RLRun = serde_yaml_ng::from_str(&cm.data.unwrap()["rlrun.yaml"]).unwrap();
    assert_eq!(back.spec, run.spec);
    assert_eq!(back.metadata.name.as_deref(), Some("gsm8k-grpo"));
}

#[test]
fn the_role_reaches_only_its_own_run() {
    let role = build(&example_run()).role;
    for rule in role.rules.unwrap() {
        if rule.api_groups.as_deref() == Some(&["moult.dev".to_string()][..]) {
            assert_eq!(
                rule.resource_names.as_deref(),
                Some(&["gsm8k-grpo".to_string()][..])
            );
            assert!(!rule
                .verbs
                .iter()
                .any(|v| v == "list" || v == "delete" || v == "create"));
        }
    }
}

#[test]
fn a_queue_makes_one_kueue_workload_of_every_role_and_the_priority_class_reaches_every_pod() {
    let mut run = example_run();
    assert!(build(&run).workload.is_none(), "no queue, no Workload");
    run.spec.scheduling.queue_name = Some("team-a".into());
    run.spec.scheduling.priority_class_name = Some("rl-batch".into());
    let c = build(&run);
    for t in [
        &c.engines.clone().unwrap().spec.template,
        &c.agents.spec.template,
    ] {
        let labels = t.metadata.clone().unwrap().labels.unwrap();
        assert!(
            !labels.contains_key(super::QUEUE_LABEL),
            "pods are not Kueue's one by one"
        );
        let spec = t.spec.as_ref().unwrap();
        assert_eq!(spec.priority_class_name.as_deref(), Some("rl-batch"));
    }
    let w = c.workload.clone().unwrap();
    assert_eq!(w["apiVersion"], "kueue.x-k8s.io/v1beta2");
    assert_eq!(w["spec"]["queueName"], "team-a");
    assert_eq!(w["spec"]["active"], true);
    let name = c.workload_name().unwrap();
    assert!(
        name.starts_with(&format!("{}-kueue-", run.name_any())),
        "{name}"
    );
    let sets = w["spec"]["podSets"].as_array().unwrap();
    let counts: Vec<(&str, i64)> = sets
        .iter()
        .map(|p| (p["name"].as_str().unwrap(), p["count"].as_i64().unwrap()))
        .collect();
    let spec = &run.spec;
    let expected = [
        ("engines", spec.engines.replicas.into()),
        ("trainer", spec.trainer.nodes.into()),
        ("coordinator", 1),
        ("agents", spec.agent.replicas.into()),
    ];
    assert_eq!(counts, expected);
    // What Kueue admits by, and nothing else: the engines' GPUs, not their arguments.
    let engine = &sets[0]["template"]["spec"]["containers"][0];
    assert_eq!(
        engine["resources"]["limits"]["nvidia.com/gpu"],
        c.engines
            .clone()
            .unwrap()
            .spec
            .template
            .spec
            .as_ref()
            .unwrap()
            .containers[0]
            .resources
            .as_ref()
            .unwrap()
            .limits
            .as_ref()
            .unwrap()["nvidia.com/gpu"]
            .0
            .as_str()
    );
    assert!(
        engine.get("args").is_none() && engine.get("image").is_none(),
        "{engine}"
    );
    // The same run with another image keeps its Workload; more engines make a new one (Kueue
    // does not let an admitted Workload's pod sets change).
    let mut other = run.clone();
    other.spec.engines.image = Some("engine:2".into());
    assert_eq!(build(&other).workload_name().unwrap(), name);
    other.spec.engines.replicas += 1;
    assert_ne!(build(&other).workload_name().unwrap(), name);
    // Suspended: the Workload gives its quota back.
    other.spec.suspend = true;
    assert_eq!(build(&other).workload.unwrap()["spec"]["active"], false);
    // Kueue's own label on the run works as the field does.
    let mut labelled = example_run();
    labelled.metadata.labels =
        Some([(super::QUEUE_LABEL.to_string(), "team-b".to_string())].into());
    assert_eq!(
        build(&labelled).workload.unwrap()["spec"]["queueName"],
        "team-b"
    );
}

#[test]
fn a_queued_run_has_no_pods_and_an_admitted_one_goes_where_its_flavors_say() {
    let mut run = example_run();
    run.spec.scheduling.queue_name = Some("team-a".into());
    let mut held = build(&run);
    held.hold();
    assert_eq!(held.engines.clone().unwrap().spec.replicas, Some(0));
    assert_eq!(held.trainer.spec.replicas, Some(0));
    assert_eq!(held.coordinator.spec.replicas, Some(0));
    assert_eq!(held.agents.spec.replicas, Some(0));
    let mut placed = build(&run);
    let toleration = Toleration {
        key: Some("pool".into()),
        operator: Some("Exists".into()),
        ..Toleration::default()
    };
    let gpu = super::Placement {
        node_labels: [("pool".to_string(), "a100".to_string())].into(),
        tolerations: vec![toleration.clone()],
    };
    placed.place(&[("engines".to_string(), gpu)].into());
    let engines = placed
        .engines
        .as_ref()
        .unwrap()
        .spec
        .template
        .spec
        .as_ref()
        .unwrap();
    assert_eq!(engines.node_selector.as_ref().unwrap()["pool"], "a100");
    assert!(engines.tolerations.as_ref().unwrap().contains(&toleration));
    let agents = placed.agents.spec.template.spec.as_ref().unwrap();
    assert!(agents
        .node_selector
        .as_ref()
        .is_none_or(|s| !s.contains_key("pool")));
    assert_eq!(
        placed.engines.clone().unwrap().spec.replicas,
        build(&run).engines.clone().unwrap().spec.replicas,
        "admitted: as many as the spec says"
    );
}

#[test]
fn the_runtime_class_reaches_the_agent_pods_alone() {
    let mut run = example_run();
    let agents = build(&run).agents.spec.template.spec.unwrap();
    assert_eq!(agents.runtime_class_name, None);
    run.spec.agent.runtime_class_name = Some("gvisor".into());
    let c = build(&run);
    let agents = c.agents.spec.template.clone().spec.unwrap();
    assert_eq!(agents.runtime_class_name.as_deref(), Some("gvisor"));
    for t in [
        &c.engines.clone().unwrap().spec.template,
        &c.trainer.spec.template,
    ] {
        assert_eq!(t.spec.as_ref().unwrap().runtime_class_name, None);
    }
}

/// The code recipe at GPU scale (examples/code/rlrun-cluster.yaml) is a valid run whose agent
/// pods alone run under its RuntimeClass, with a jail per episode and the manifest's limits.
#[test]
fn the_code_recipes_cluster_manifest_builds_sandboxed_agents() {
    let run = run_of(include_str!("../../../examples/code/rlrun-cluster.yaml"));
    assert_eq!(run.validate(), Ok(()));
    assert_eq!(run.spec.agent.isolation, crate::api::Isolation::Episode);
    let c = build(&run);
    let agents = c.agents.spec.template.clone().spec.unwrap();
    assert_eq!(agents.runtime_class_name.as_deref(), Some("gvisor"));
    for t in [
        &c.engines.clone().unwrap().spec.template,
        &c.trainer.spec.template,
    ] {
        assert_eq!(t.spec.as_ref().unwrap().runtime_class_name, None);
    }
    // A sandbox pod per episode: the template runs `moult sandbox --serve` in the sandbox image,
    // under the same RuntimeClass, knowing only the hash of the agents' key.
    let sandbox = c
        .sandbox
        .clone()
        .expect("spec.agent.sandbox makes sandbox children");
    let t = &sandbox.template;
    assert_eq!(t["kind"], "SandboxTemplate");
    let pod = &t["spec"]["podTemplate"]["spec"];
    assert_eq!(pod["runtimeClassName"], "gvisor");
    assert_eq!(pod["automountServiceAccountToken"], false);
    let container = &pod["containers"][0];
    assert_eq!(container["image"], "python:3.13-slim");
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    assert_eq!(
        args,
        [
            "sandbox",
            "--serve",
            "0.0.0.0:7070",
            "--workspace",
            "/tmp/workspace",
            "--isolation",
            "episode"
        ]
    );
    let env = container["env"].to_string();
    let agent_credential = crate::credentials::agent_credential("secret-token");
    assert!(
        env.contains(&super::sandbox::verifier(&agent_credential)),
        "{env}"
    );
    assert!(
        !env.contains(&agent_credential) && !env.contains("secretKeyRef"),
        "{env}"
    );
    assert_eq!(t["spec"]["networkPolicy"]["egress"], serde_json::json!([]));
    let from = &t["spec"]["networkPolicy"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"];
    assert_eq!(from[COMPONENT_LABEL], "agents");
    assert_eq!(sandbox.warm_pool["spec"]["replicas"], 64);
    assert_eq!(
        sandbox.warm_pool["spec"]["sandboxTemplateRef"]["name"],
        "code-sandbox"
    );
    // The agent pods claim them with an API credential of their own, in the agent container
    // alone: agent code, in the sandbox container, gets none.
    assert_eq!(agents.service_account_name.as_deref(), Some("code-agents"));
    assert_eq!(agents.automount_service_account_token, Some(false));
    let mounted = |c: &Container| {
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.name == "api-credential")
    };
    assert!(mounted(&agents.containers[0]) && !mounted(&agents.containers[1]));
    let agent_env: Vec<&str> = agents.containers[0]
        .env
        .iter()
        .flatten()
        .map(|e| e.name.as_str())
        .collect();
    assert!(agent_env.contains(&"MOULT_SANDBOX_POOL") && agent_env.contains(&"MOULT_POD_UID"));
    let rules = sandbox.role.rules.clone().unwrap_or_default();
    let resources: Vec<&str> = rules
        .iter()
        .flat_map(|r| r.resources.iter().flatten())
        .map(String::as_str)
        .collect();
    assert_eq!(
        resources,
        ["sandboxclaims", "sandboxes", "sandboxtemplates"]
    );
    // Agent pods reach their sandbox pods; the children list applies the template before the pool.
    let egress = serde_json::to_value(&c.network_policies.agents)
        .unwrap()
        .to_string();
    assert!(
        egress.contains("\"sandbox\"") && egress.contains("7070"),
        "{egress}"
    );
    let kinds: Vec<ChildKind> = c.clone().into_list().iter().map(|c| c.kind).collect();
    let at = |k| kinds.iter().position(|x| *x == k).unwrap();
    assert!(at(ChildKind::SandboxTemplate) < at(ChildKind::SandboxWarmPool));
    // Suspended, no sandbox pod waits.
    let mut suspended = run.clone();
    suspended.spec.suspend = true;
    let warm = build(&suspended).sandbox.unwrap().warm_pool;
    assert_eq!(warm["spec"]["replicas"], 0);
    // The agent pods read the run's spec, limits included, from its ConfigMap.
    let data = c.config.data.unwrap_or_default();
    let spec: serde_json::Value =
        serde_yaml_ng::from_str(data.values().next().expect("the spec")).unwrap();
    let limits = &spec["spec"]["agent"]["limits"];
    assert_eq!(
        (&limits["cpuSeconds"], &limits["memory"]),
        (&120.into(), &"4Gi".into()),
        "{spec}"
    );
}

#[test]
fn a_run_without_uid_is_refused_not_built_without_owner() {
    let mut run = example_run();
    run.metadata.uid = None;
    assert!(desired(&run, &Config::default(), "t").is_err());
}

#[test]
fn the_applied_hash_changes_when_a_field_leaves_the_desired_object() {
    let mut run = example_run();
    let hash = |run: &RLRun| {
        let list = build(run).into_list();
        let engines = list
            .iter()
            .find(|c| c.name == "gsm8k-grpo-engine" && c.kind == ChildKind::StatefulSet)
            .unwrap();
        engines.object["metadata"]["annotations"][APPLIED_HASH_ANNOTATION]
            .as_str()
            .unwrap()
            .to_string()
    };
    let with_resources = hash(&run);
    assert_eq!(hash(&run), with_resources, "the hash is stable");
    run.spec.engines.resources = None;
    assert_ne!(hash(&run), with_resources);
}

fn mounts(c: &Container) -> Vec<(&str, &str, bool)> {
    c.volume_mounts
        .iter()
        .flatten()
        .map(|m| {
            (
                m.name.as_str(),
                m.mount_path.as_str(),
                m.read_only == Some(true),
            )
        })
        .collect()
}

#[test]
fn the_filesystem_transport_mounts_its_claim_in_trainer_and_engines() {
    use crate::api::{WeightTransferSpec, WeightTransport};
    let mut run = example_run();
    // NCCL (vLLM's default) needs vLLM's weight-transfer engine; nothing is mounted.
    let nccl = build(&run);
    let e = pod(&Some(nccl.engines.clone().unwrap().spec.template.clone())).clone();
    assert!(args(main_container(&e)).contains(&"--weight-transfer-config"));
    assert!(!mounts(main_container(&e)).iter().any(|m| m.0 == "weights"));

    run.spec.engines.weight_transfer = Some(WeightTransferSpec {
        transport: WeightTransport::Filesystem,
        claim_name: Some("rl-weights".into()),
    });
    let c = build(&run);
    let e = pod(&Some(c.engines.clone().unwrap().spec.template.clone())).clone();
    let t = pod(&Some(c.trainer.spec.template.clone())).clone();
    // Engines reload from the folder through /collective_rpc: no NCCL transfer engine.
    assert!(!args(main_container(&e)).contains(&"--weight-transfer-config"));
    assert!(mounts(main_container(&e)).contains(&("weights", "/weights", true)));
    assert!(mounts(main_container(&t)).contains(&("weights", "/weights", false)));
    for p in [&e, &t] {
        let claim = p
            .volumes
            .iter()
            .flatten()
            .find(|v| v.name == "weights")
            .and_then(|v| v.persistent_volume_claim.as_ref())
            .expect("the weights volume is the claim");
        assert_eq!(claim.claim_name, "rl-weights");
    }
    let env = main_container(&t).env.clone().unwrap();
    assert!(env
        .iter()
        .any(|v| v.name == "MOULT_WEIGHTS_DIR" && v.value.as_deref() == Some("/weights")));

    // Without a claim a cluster has no shared folder: refused, naming the field.
    run.spec
        .engines
        .weight_transfer
        .as_mut()
        .unwrap()
        .claim_name = None;
    let err = desired(&run, &Config::default(), "t").unwrap_err();
    assert!(
        err.0.starts_with("spec.engines.weightTransfer.claimName:"),
        "{err}"
    );
}

#[test]
fn every_container_reports_its_last_log_lines_when_it_fails() {
    let c = build(&example_run());
    for t in [
        c.engines.clone().unwrap().spec.template,
        c.trainer.spec.template,
        c.coordinator.spec.template,
        c.agents.spec.template,
    ] {
        let p = t.spec.unwrap();
        for c in p
            .containers
            .iter()
            .chain(p.init_containers.iter().flatten())
        {
            assert_eq!(
                c.termination_message_policy.as_deref(),
                Some("FallbackToLogsOnError"),
                "{}",
                c.name
            );
        }
    }
}

/// Every flag the operator puts on an engine's command line (vLLM's with every option on, and
/// the built-in engine's) is refused in `engines.extraArgs`, in each spelling vLLM takes.
#[cfg(feature = "validate")]
#[test]
fn every_flag_moult_sets_on_an_engine_is_refused_in_extra_args() {
    use crate::api::RESERVED_ENGINE_FLAGS;
    let mut run = example_run();
    run.spec.routing_replay = true;
    run.spec.model.max_model_len = Some(4096);
    let mut set: Vec<String> = vllm_args(&run.spec, "/m", "0.0.0.0", 8000, "r", EngineRole::Policy)
        .into_iter()
        .filter(|a| a.starts_with('-'))
        .collect();
    let mut builtin = example_run();
    builtin.spec.engines.backend = EngineBackend::Builtin;
    builtin.spec.engines.tensor_parallel_size = 1;
    builtin.spec.engines.weight_transfer = None;
    let engine = build(&builtin)
        .engines
        .clone()
        .unwrap()
        .spec
        .template
        .spec
        .unwrap();
    set.extend(
        args(&engine.containers[0])
            .into_iter()
            .filter(|a| a.starts_with('-'))
            .map(String::from),
    );
    for flag in &set {
        assert!(
            RESERVED_ENGINE_FLAGS.contains(&flag.as_str()),
            "{flag} is set by moult but not in RESERVED_ENGINE_FLAGS"
        );
    }
    let refused = |extra: Vec<String>| {
        let mut r = example_run();
        r.spec.engines.extra_args = extra;
        r.validate().is_err()
    };
    for flag in RESERVED_ENGINE_FLAGS {
        let underscored = format!("--{}", flag.trim_start_matches('-').replace('-', "_"));
        for form in [
            vec![flag.to_string(), "1".into()],
            vec![format!("{flag}=1")],
            vec![format!("{flag}.key"), "1".into()],
            vec![underscored.clone(), "1".into()],
        ] {
            if flag.starts_with("--") || !form[0].starts_with("--") {
                assert!(refused(form.clone()), "{form:?} is refused");
            }
        }
        // argparse's abbreviations: every prefix with a character after the dashes.
        let dashes = if flag.starts_with("--") { 2 } else { 1 };
        for end in dashes + 1..flag.len() {
            let abbreviation = &flag[..end];
            assert!(
                refused(vec![abbreviation.to_string(), "1".into()]),
                "{abbreviation} (abbreviating {flag}) is refused"
            );
            assert!(refused(vec![format!("{abbreviation}=1")]));
        }
    }
    // The message names the flag that the refused argument abbreviates.
    let mut r = example_run();
    r.spec.engines.extra_args = vec!["--served_model".into(), "x".into()];
    let errors = r.validate().unwrap_err();
    assert!(
        errors.iter().any(|e| e.contains(
            "engines.extraArgs cannot set a flag moult sets itself: --served-model-name"
        )),
        "{errors:?}"
    );
    for fine in [
        vec!["--enforce-eager".to_string()],
        vec!["--dtype".into(), "bfloat16".into()],
        vec!["--hosts-file".into(), "x".into()],
        vec!["--max-num-seqs=8".into()],
        vec!["--model-impl".into(), "transformers".into()],
        vec!["--".into(), "-".into(), "-1".into()],
    ] {
        assert!(!refused(fine.clone()), "{fine:?} is accepted");
    }
    for bad in [
        vec!["--dtype".to_string(), "int8".into()],
        vec!["--dtype=fp8".into()],
        vec!["--dtype".into()],
    ] {
        assert!(refused(bad.clone()), "{bad:?} is refused");
    }
}

#[test]
fn engines_are_restarted_when_their_health_fails_after_a_long_load() {
    for backend in [
        crate::api::EngineBackend::Builtin,
        crate::api::EngineBackend::Vllm,
    ] {
        let mut run = example_run();
        run.spec.engines.backend = backend;
        let p = build(&run)
            .engines
            .clone()
            .unwrap()
            .spec
            .template
            .spec
            .unwrap();
        let c = &p.containers[0];
        let path = |probe: &Option<k8s_openapi::api::core::v1::Probe>| {
            probe
                .as_ref()
                .unwrap()
                .http_get
                .as_ref()
                .unwrap()
                .path
                .clone()
        };
        for probe in [&c.readiness_probe, &c.liveness_probe, &c.startup_probe] {
            assert_eq!(path(probe).as_deref(), Some("/health"), "{backend:?}");
        }
        let startup = c.startup_probe.as_ref().unwrap();
        let patience = startup.failure_threshold.unwrap() * startup.period_seconds.unwrap();
        assert!(
            patience >= 30 * 60,
            "{backend:?}: a large model loads for up to 30 minutes"
        );
    }
}

#[test]
fn rollout_dumps_need_the_checkpoint_claim_they_are_written_to() {
    let mut run = example_run();
    run.spec.trainer.dump_rollouts = true;
    assert!(desired(&run, &Config::default(), "t").is_ok());
    run.spec.checkpoint = None;
    let Err(InvalidSpec(err)) = desired(&run, &Config::default(), "t") else {
        panic!("dumps with nowhere to go were accepted");
    };
    assert!(
        err.starts_with("spec.trainer.dumpRollouts:") && err.contains("spec.checkpoint"),
        "{err}"
    );
}

#[test]
fn agent_pods_reach_the_api_server_at_its_endpoints_addresses() {
    let slice: k8s_openapi::api::discovery::v1::EndpointSlice =
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "kubernetes"},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["172.18.0.2", "172.18.0.3"]}],
            "ports": [{"name": "https", "port": 6443, "protocol": "TCP"}],
        }))
        .unwrap();
    let rule = serde_json::to_value(egress_to(&[slice]).expect("a rule")).unwrap();
    assert_eq!(
        rule,
        serde_json::json!({
            "to": [{"ipBlock": {"cidr": "172.18.0.2/32"}}, {"ipBlock": {"cidr": "172.18.0.3/32"}}],
            "ports": [{"port": 6443, "protocol": "TCP"}],
        })
    );
    assert_eq!(egress_to(&[]), None);
}

#[test]
fn trainer_pods_have_the_spec_grace_and_stop_a_little_before_it_ends() {
    let mut run = example_run();
    for (set, grace) in [(None, 120), (Some(600), 600)] {
        run.spec.trainer.termination_grace_period_seconds = set;
        let template = Some(build(&run).trainer.spec.template);
        let pod = pod(&template);
        assert_eq!(pod.termination_grace_period_seconds, Some(grace));
        let env = main_container(pod).env.clone().unwrap();
        let stop = env.iter().find(|v| v.name == "MOULT_STOP_SECONDS").unwrap();
        assert_eq!(stop.value, Some((grace - 5).to_string()));
    }
}

#[test]
fn disruption_budgets_guard_the_trainer_and_the_coordinator_only_when_the_operator_asks() {
    let mut run = example_run();
    let budgets = |c: &Children| -> Vec<Child> {
        c.clone()
            .into_list()
            .into_iter()
            .filter(|x| x.kind == ChildKind::PodDisruptionBudget)
            .collect()
    };
    // Off by default: no budget at all.
    let off = build(&run);
    assert!(off.disruption_budgets.is_empty());
    assert!(budgets(&off).is_empty());

    let config = Config {
        disruption_budgets: true,
        ..Config::default()
    };
    let on = desired(&run, &config, "secret-token").expect("the example builds");
    let list = budgets(&on);
    let names: Vec<&str> = list.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(names, ["gsm8k-grpo-trainer", "gsm8k-grpo-coordinator"]);
    let workloads = [
        (
            "trainer",
            &on.trainer.spec.selector,
            &on.trainer.spec.template,
        ),
        (
            "coordinator",
            &on.coordinator.spec.selector,
            &on.coordinator.spec.template,
        ),
    ];
    for (b, (role, selector, template)) in list.iter().zip(workloads) {
        let o = &b.object;
        assert_eq!(o["apiVersion"], "policy/v1");
        assert_eq!(o["kind"], "PodDisruptionBudget");
        assert_eq!(o["spec"]["maxUnavailable"], 0, "{role}: no eviction at all");
        assert!(o["spec"]["minAvailable"].is_null(), "{role}");
        assert_eq!(o["spec"]["unhealthyPodEvictionPolicy"], "AlwaysAllow");
        // The workload's own selector, which its pods carry.
        assert_eq!(
            o["spec"]["selector"],
            serde_json::to_value(selector).unwrap(),
            "{role}"
        );
        let matched = o["spec"]["selector"]["matchLabels"].as_object().unwrap();
        assert_eq!(matched[COMPONENT_LABEL], role);
        assert_eq!(matched[RUN_LABEL], "gsm8k-grpo");
        let pod_labels = template.metadata.as_ref().unwrap().labels.as_ref().unwrap();
        for (k, v) in matched {
            assert_eq!(pod_labels.get(k).map(String::as_str), v.as_str(), "{k}");
        }
        let owner = &o["metadata"]["ownerReferences"][0];
        assert_eq!(owner["kind"], "RLRun");
        assert_eq!(owner["controller"], true);
        assert_eq!(owner["uid"], "0b1c6a52-5d1e-4f2a-9a55-7f3a1f6c1e01");
        assert_eq!(o["metadata"]["labels"][MANAGED_BY_LABEL], MANAGED_BY);
        assert_eq!(o["metadata"]["labels"][RUN_LABEL], "gsm8k-grpo");
    }
    // Applied before the workloads whose pods they protect; listed for orphans like every kind.
    let kinds: Vec<ChildKind> = on.clone().into_list().iter().map(|c| c.kind).collect();
    let at = |k| kinds.iter().position(|x| *x == k).unwrap();
    assert!(at(ChildKind::PodDisruptionBudget) < at(ChildKind::StatefulSet));
    assert!(ChildKind::ALL.contains(&ChildKind::PodDisruptionBudget));
    // Suspended: the budgets stay, with no pod to hold.
    run.spec.suspend = true;
    let suspended = desired(&run, &config, "secret-token").unwrap();
    assert_eq!(suspended.disruption_budgets, on.disruption_budgets);
    assert_eq!(suspended.trainer.spec.replicas, Some(0));
    // Succeeded: none, so that the finished run's pods do not block drains.
    run.spec.suspend = false;
    run.status = Some(crate::api::RLRunStatus {
        phase: Some(crate::api::Phase::Succeeded),
        ..Default::default()
    });
    let done = desired(&run, &config, "secret-token").unwrap();
    assert!(done.disruption_budgets.is_empty());
}

/// The EnginePool and the two RLRuns of the pool example, as the API server would hand them over.
pub(crate) fn pool_example() -> (crate::api::EnginePool, Vec<RLRun>) {
    let text = include_str!("../../../examples/cluster/lora-pool.yaml");
    let mut pool = None;
    let mut runs = Vec::new();
    for (i, doc) in text.split("\n---\n").enumerate() {
        let uid = format!("7c1d2e3f-0000-4000-8000-00000000000{i}");
        if doc.contains("kind: EnginePool") {
            let mut p: crate::api::EnginePool = serde_yaml_ng::from_str(doc).unwrap();
            p.metadata.namespace = Some("research".into());
            p.metadata.uid = Some(uid);
            pool = Some(p);
        } else if doc.contains("kind: RLRun") {
            let mut r: RLRun = serde_yaml_ng::from_str(doc).unwrap();
            r.metadata.namespace = Some("research".into());
            r.metadata.uid = Some(uid);
            runs.push(r);
        }
    }
    (pool.expect("the example has an EnginePool"), runs)
}
