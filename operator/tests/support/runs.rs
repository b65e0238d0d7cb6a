//! Every kind of run the operator builds, as the API server would hand it over (a namespace and
//! a uid): the examples (each made buildable on a cluster) and variations of the cluster example
//! that switch on each optional part of the spec.

use moult_operator::api::{
    AgentEgressSpec, AgentForm, EgressPort, EgressTarget, EngineBackend, Estimator, Protocol,
    RLRun, TeacherSpec, WeightTransferSpec, WeightTransport,
};

pub const NAMESPACE: &str = "research";
pub const UID: &str = "0b1c6a52-5d1e-4f2a-9a55-7f3a1f6c1e01";

/// The RLRun of a manifest (the RLRun document of a multi-document file), with namespace and uid.
/// Agents opened to HTTPS anywhere outside the cluster's 10/8 and the cloud metadata address.
pub fn https_egress() -> AgentEgressSpec {
    AgentEgressSpec {
        allow_all: false,
        to: vec![EgressTarget {
            cidr: "0.0.0.0/0".into(),
            except: vec!["10.0.0.0/8".into(), "169.254.169.254/32".into()],
            ports: vec![EgressPort {
                port: 443,
                end_port: None,
                protocol: Protocol::Tcp,
            }],
        }],
    }
}

pub fn parse(text: &str) -> RLRun {
    let doc = text
        .split("\n---\n")
        .find(|d| d.contains("kind: RLRun"))
        .expect("an RLRun document");
    let mut run: RLRun = serde_yaml_ng::from_str(doc).expect("the manifest parses");
    run.metadata.namespace = Some(NAMESPACE.into());
    run.metadata.uid = Some(UID.into());
    run
}

fn example(path: &str) -> RLRun {
    let full = format!("{}/../examples/{path}", env!("CARGO_MANIFEST_DIR"));
    parse(&std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{full}: {e}")))
}

/// The cluster example: vLLM over NCCL on GPUs, claims for model, data and checkpoints.
pub fn cluster_example() -> RLRun {
    example("cluster/gsm8k-grpo.yaml")
}

/// Every kind of run, named.
pub fn run_kinds() -> Vec<(String, RLRun)> {
    let mut kinds: Vec<(String, RLRun)> = Vec::new();
    let mut add = |name: &str, run: RLRun| kinds.push((name.to_string(), run));
    add("cluster example (vLLM, NCCL)", cluster_example());
    add(
        "successor (built-in engine, TCP)",
        example("successor/rlrun.yaml"),
    );
    let mut fs = example("successor/rlrun-vllm.yaml");
    // A cluster's Filesystem transport needs its ReadWriteMany claim.
    fs.spec.engines.weight_transfer.as_mut().unwrap().claim_name = Some("weights".into());
    add("successor on vLLM (Filesystem)", fs);
    add("distillation", example("distill/rlrun.yaml"));
    add(
        "vision-language geometry (built-in)",
        example("geometry/rlrun.yaml"),
    );
    add(
        "geo3k-shaped vision-language run (vLLM, NCCL, 16 ranks)",
        example("geometry/rlrun-cluster.yaml"),
    );
    add("ChatAgent with tools", example("chat-tools/rlrun.yaml"));
    let mut judged = example("judge/rlrun.yaml");
    judged.spec.judge = None; // a cluster refuses a judge so far
    add("judge example without its judge", judged);

    let base = cluster_example();
    let variant = |f: &dyn Fn(&mut RLRun)| {
        let mut r = base.clone();
        f(&mut r);
        r
    };
    add("routing replay", variant(&|r| r.spec.routing_replay = true));
    add(
        "CPU built-in engines",
        variant(&|r| {
            r.spec.engines.backend = EngineBackend::Builtin;
            r.spec.engines.tensor_parallel_size = 1;
            r.spec.engines.gpus_per_engine = Some(0);
        }),
    );
    add(
        "vLLM over a shared folder",
        variant(&|r| {
            r.spec.engines.weight_transfer = Some(WeightTransferSpec {
                transport: WeightTransport::Filesystem,
                claim_name: Some("rl-weights".into()),
            })
        }),
    );
    add(
        "distillation from a claim",
        variant(&|r| {
            r.spec.algorithm.estimator = Estimator::OnPolicyDistillation;
            r.spec.algorithm.teacher = Some(TeacherSpec {
                path: "Qwen3-32B".into(),
                claim_name: Some("teachers".into()),
                replicas: None,
            });
        }),
    );
    add(
        "distillation from a served teacher",
        variant(&|r| {
            r.spec.algorithm.estimator = Estimator::OnPolicyDistillation;
            r.spec.algorithm.teacher = Some(TeacherSpec {
                path: "Qwen3-32B".into(),
                claim_name: Some("teachers".into()),
                replicas: Some(2),
            });
        }),
    );
    add(
        "ChatAgent writing into its image",
        variant(&|r| {
            r.spec.agent.form = AgentForm::ChatAgent;
            r.spec.agent.image = Some("python:3.12-slim".into());
            r.spec.agent.command = vec!["python".into(), "agent.py".into()];
            r.spec.agent.read_only_root_filesystem = false;
        }),
    );
    add(
        "agents opened to HTTPS outside the cluster",
        variant(&|r| r.spec.agent.egress = Some(https_egress())),
    );
    add(
        "agents opened to everything",
        variant(&|r| {
            r.spec.agent.egress = Some(AgentEgressSpec {
                allow_all: true,
                to: Vec::new(),
            })
        }),
    );
    add(
        "queued, prioritised, tolerating and with disk limits",
        variant(&|r| {
            let s = &mut r.spec.scheduling;
            s.queue_name = Some("team-a".into());
            s.priority_class_name = Some("rl-batch".into());
            s.tolerations = vec![serde_json::from_value(serde_json::json!(
                {"key": "team", "operator": "Equal", "value": "a", "effect": "NoSchedule"}
            ))
            .unwrap()];
            let engines = r
                .spec
                .engines
                .resources
                .get_or_insert_with(Default::default);
            engines.limits.get_or_insert_with(Default::default).insert(
                "ephemeral-storage".into(),
                k8s_openapi::apimachinery::pkg::api::resource::Quantity("200Gi".into()),
            );
        }),
    );
    add("suspended", variant(&|r| r.spec.suspend = true));
    kinds
}
