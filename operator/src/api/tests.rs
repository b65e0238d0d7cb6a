//! Tests of the spec's defaults and of CEL rules that span fields.

mod judge_tests {
    use crate::api::*;

    fn run(judge: &str, estimator: &str) -> RLRun {
        let yaml = format!(
            "apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {{name: judged, namespace: local}}
spec:
  model: {{path: /models/policy}}
  agent: {{env: successor, dataset: {{path: tasks.jsonl}}}}
  algorithm: {{estimator: {estimator}, teacher: {{path: /models/teacher}}}}
  judge: {judge}
  totalSteps: 1
"
        );
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    fn refused(run: &RLRun, message: &str) -> bool {
        run.validate()
            .expect_err(message)
            .iter()
            .any(|e| e.contains(message))
    }

    #[test]
    fn a_judge_defaults_its_weights_and_validates() {
        let r = run(
            "{path: judge, prompt: 'Is {response} right for {task.n}?'}",
            "GRPO",
        );
        let judge = r.spec.judge.as_ref().unwrap();
        assert_eq!(
            (judge.weight, judge.agent_weight, judge.max_tokens),
            (1.0, 1.0, 8)
        );
        assert_eq!(r.validate(), Ok(()));
    }

    #[test]
    fn judge_rules_refuse_with_messages_naming_the_fields() {
        let no_response = run("{path: judge, prompt: 'Is it right?'}", "GRPO");
        assert!(refused(
            &no_response,
            "judge.prompt must contain {response}"
        ));
        let zero = run(
            "{path: judge, prompt: '{response}', weight: 0, agentWeight: 0}",
            "GRPO",
        );
        assert!(refused(
            &zero,
            "judge.weight and judge.agentWeight are both 0"
        ));
        let distill = run(
            "{path: judge, prompt: '{response}'}",
            "OnPolicyDistillation",
        );
        assert!(refused(&distill, "remove judge or pick GRPO"));
        // Training on the judge alone, or only logging its score, is fine.
        let alone = run(
            "{path: judge, prompt: '{response}', agentWeight: 0}",
            "GRPO",
        );
        assert_eq!(alone.validate(), Ok(()));
    }
}

mod weight_transfer_tests {
    use crate::api::*;

    fn run(engines: &str) -> RLRun {
        let yaml = format!(
            "apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {{name: transfer, namespace: local}}
spec:
  model: {{path: /models/policy}}
  agent: {{env: successor, dataset: {{path: tasks.jsonl}}}}
  engines: {engines}
  totalSteps: 1
"
        );
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    #[test]
    fn each_backend_has_its_own_transport_by_default() {
        assert_eq!(
            run("{backend: vLLM}").spec.engines.transport(),
            WeightTransport::Nccl
        );
        assert_eq!(
            run("{backend: Builtin}").spec.engines.transport(),
            WeightTransport::Tcp
        );
        let fs = run("{backend: vLLM, weightTransfer: {transport: Filesystem, claimName: w}}");
        assert_eq!(fs.spec.engines.transport(), WeightTransport::Filesystem);
        assert_eq!(fs.validate(), Ok(()));
    }

    #[test]
    fn transports_an_engine_cannot_take_are_refused_naming_the_field() {
        for (engines, message) in [
            (
                "{backend: Builtin, weightTransfer: {transport: Nccl}}",
                "engines.weightTransfer.transport Nccl is for vLLM engines",
            ),
            (
                "{backend: vLLM, weightTransfer: {transport: Tcp}}",
                "engines.weightTransfer.transport Tcp is the built-in engine's weight stream",
            ),
            (
                "{backend: Builtin, weightTransfer: {transport: Tcp, claimName: w}}",
                "engines.weightTransfer.claimName is the folder of the Filesystem transport",
            ),
        ] {
            let errors = run(engines).validate().expect_err(engines);
            assert!(
                errors.iter().any(|e| e.contains(message)),
                "{engines}: {errors:?}"
            );
        }
    }
}

mod teacher_tests {
    use crate::api::*;

    fn run(teacher: &str, temperature: f64) -> RLRun {
        let yaml = format!(
            "apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {{name: distilled, namespace: local}}
spec:
  model: {{path: /models/policy}}
  agent: {{env: successor, dataset: {{path: tasks.jsonl}}}}
  algorithm: {{estimator: OnPolicyDistillation, teacher: {teacher}}}
  rollout: {{temperature: {temperature}}}
  totalSteps: 1
"
        );
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    #[test]
    fn a_served_teacher_needs_temperature_one_and_an_in_trainer_one_any() {
        let served = run("{path: /models/teacher, replicas: 2}", 0.7);
        let errors = served
            .validate()
            .expect_err("temperature 0.7 with a served teacher");
        assert!(
            errors
                .iter()
                .any(|e| e.contains("algorithm.teacher.replicas") && e.contains("temperature")),
            "{errors:?}"
        );
        assert!(run("{path: /models/teacher, replicas: 2}", 1.0)
            .validate()
            .is_ok());
        assert!(run("{path: /models/teacher}", 0.7).validate().is_ok());
        let zero = run("{path: /models/teacher, replicas: 0}", 1.0);
        assert!(zero.validate().is_err());
    }
}

/// A field's default does not depend on its siblings: wherever the schema gives a whole block a
/// default (what the run uses when the block is left out), each field of that default is also
/// the field's own default (what it gets when the block is written with other fields only).
mod sibling_defaults {
    use serde_json::Value;

    fn check(schema: &Value, path: &str, errors: &mut Vec<String>) {
        let props = schema.get("properties").and_then(Value::as_object);
        if let (Some(Value::Object(block)), Some(props)) = (schema.get("default"), props) {
            for (key, value) in block {
                let own = props.get(key).and_then(|p| p.get("default"));
                if own != Some(value) {
                    errors.push(format!(
                        "{path}.{key}: {value} when {path} is left out, {} when it is written without {key}",
                        own.map_or("nothing".to_string(), Value::to_string)
                    ));
                }
            }
        }
        for (key, sub) in props.into_iter().flatten() {
            check(sub, &format!("{path}.{key}"), errors);
        }
        if let Some(items) = schema.get("items") {
            check(items, &format!("{path}[]"), errors);
        }
    }

    #[test]
    fn every_block_default_is_also_each_fields_own_default() {
        let spec = &crate::rlrun_schema()["properties"]["spec"];
        let mut errors = Vec::new();
        check(spec, "spec", &mut errors);
        assert!(errors.is_empty(), "{errors:#?}");
    }
}

mod optimizer_defaults {
    use crate::api::OptimizerSpec;

    #[test]
    fn clipping_stays_on_when_other_optimizer_fields_are_set_and_zero_turns_it_off() {
        let parse = |yaml: &str| serde_yaml_ng::from_str::<OptimizerSpec>(yaml).unwrap();
        assert_eq!(parse("{learningRate: 1.0e-5}").clip_norm(), Some(1.0));
        assert_eq!(parse("{}"), OptimizerSpec::default());
        assert_eq!(parse("{maxGradNorm: 0.5}").clip_norm(), Some(0.5));
        assert_eq!(parse("{maxGradNorm: 0}").clip_norm(), None);
    }
}

mod agent_limits_tests {
    use crate::api::*;

    fn run(agent: &str, coordinator: &str) -> RLRun {
        let yaml = format!(
            "apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {{name: limited, namespace: local}}
spec:
  model: {{path: /models/policy}}
  agent: {{env: successor, dataset: {{path: tasks.jsonl}}, {agent}}}
  coordinator: {coordinator}
  totalSteps: 1
"
        );
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    #[test]
    fn agent_limits_scale_with_the_sessions_unless_set() {
        // 4 pods of 16 sessions: 64 sessions.
        let r = run("replicas: 4, concurrency: 16", "{}");
        assert_eq!(r.spec.agent_limits(), [8 * 64 + 64, 4 * 64, 2048 << 20]);
        // No agent pods yet (scaled to 0): the limits of one.
        let r = run("replicas: 0, concurrency: 16", "{}");
        assert_eq!(r.spec.agent_limits(), [8 * 16 + 64, 4 * 16, 2048 << 20]);
        let r = run(
            "concurrency: 8",
            "{agentLimits: {generations: 3, episodeMiB: 300}}",
        );
        assert_eq!(r.spec.agent_limits(), [8 * 8 + 64, 3, 300 << 20]);
        assert_eq!(r.validate(), Ok(()));
        // Less than one episode's most is refused, naming the field.
        let r = run("concurrency: 8", "{agentLimits: {episodeMiB: 100}}");
        let errors = r.validate().unwrap_err();
        assert!(
            errors
                .iter()
                .any(|e| e.contains("spec.coordinator.agentLimits.episodeMiB")),
            "{errors:?}"
        );
    }
}

mod lora_tests {
    use crate::api::*;

    fn run(lora: &str, engines: &str, trainer: &str) -> RLRun {
        let yaml = format!(
            "apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {{name: lora, namespace: local}}
spec:
  model: {{path: /models/policy, lora: {lora}}}
  agent: {{env: successor, dataset: {{path: tasks.jsonl}}}}
  engines: {engines}
  trainer: {trainer}
  totalSteps: 1
"
        );
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    #[test]
    fn a_lora_adapter_defaults_to_every_projection_and_twice_the_rank() {
        let r = run("{rank: 16}", "{backend: Builtin}", "{}");
        assert_eq!(r.validate(), Ok(()));
        let lora = r.spec.model.lora.unwrap();
        assert_eq!(lora.alpha(), 32.0);
        assert_eq!(lora.dropout, 0.0);
        let names: Vec<String> = lora.target_modules.iter().map(|t| t.name()).collect();
        assert_eq!(
            names,
            [
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj"
            ]
        );
    }

    #[test]
    fn what_a_lora_run_cannot_do_is_refused_naming_the_field() {
        for (lora, engines, trainer, message) in [
            (
                "{rank: 0}",
                "{backend: Builtin}",
                "{}",
                "spec.model.lora.rank",
            ),
            (
                "{rank: 8, alpha: 0}",
                "{backend: Builtin}",
                "{}",
                "model.lora.alpha must be positive",
            ),
            (
                "{rank: 8, dropout: 1}",
                "{backend: Builtin}",
                "{}",
                "model.lora.dropout is a probability",
            ),
            (
                "{rank: 8, targetModules: []}",
                "{backend: Builtin}",
                "{}",
                "spec.model.lora.targetModules",
            ),
            (
                "{rank: 8}",
                "{backend: vLLM, weightTransfer: {transport: Nccl}}",
                "{gpusPerNode: 1}",
                "model.lora with vLLM engines: each adapter version reaches vLLM as a folder it loads",
            ),
            (
                "{rank: 8}",
                "{backend: Builtin}",
                "{nodes: 2, computeDtype: BFloat16}",
                "model.lora: the trainer computes LoRA runs in float32",
            ),
        ] {
            let errors = run(lora, engines, trainer).validate().expect_err(lora);
            assert!(
                errors.iter().any(|e| e.contains(message)),
                "{lora}: {errors:?}"
            );
        }
        // A module the schema does not know is refused by the parser, naming the accepted ones.
        let yaml = "{rank: 8, targetModules: [lm_head]}";
        let err = serde_yaml_ng::from_str::<LoraSpec>(yaml)
            .unwrap_err()
            .to_string();
        assert!(err.contains("q_proj") && err.contains("lm_head"), "{err}");
    }
}
