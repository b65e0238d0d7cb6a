//! The EnginePool's defaults and rules, and the rules of a run on a pool (`engines.poolRef`),
//! through `validate` (the CRD's schema and CEL rules evaluated here, as `moult run` does).

use crate::api::*;

fn pool(name: &str, spec: &str) -> EnginePool {
    serde_yaml_ng::from_str(&format!(
        "apiVersion: moult.dev/v1alpha1
kind: EnginePool
metadata: {{name: {name}, namespace: local}}
spec:
{spec}"
    ))
    .unwrap()
}

const BASE: &str = "  model: {path: /models/base}\n  engines: {backend: Builtin}\n";

fn run(model: &str, engines: &str) -> RLRun {
    serde_yaml_ng::from_str(&format!(
        "apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {{name: tenant, namespace: local}}
spec:
  model: {model}
  agent: {{env: repeat, dataset: {{path: tasks.jsonl}}}}
  engines: {engines}
  trainer: {{gpusPerNode: 0}}
  totalSteps: 1
"
    ))
    .unwrap()
}

const LORA: &str = "{path: /models/base, lora: {rank: 8}}";

/// The errors `validate` gives, which must include one containing `message`.
fn refused(errors: Result<(), Vec<String>>, message: &str) {
    let errors = errors.expect_err(message);
    assert!(
        errors.iter().any(|e| e.contains(message)),
        "{message:?} among {errors:?}"
    );
}

#[test]
fn a_pool_defaults_its_adapters_and_rank_and_validates() {
    let p = pool("shared", BASE);
    assert_eq!((p.spec.max_adapters, p.spec.max_rank), (8, 64));
    assert_eq!(p.spec.engines.replicas, 1);
    assert_eq!(p.validate(), Ok(()));
}

#[test]
fn a_pool_serves_the_base_model_only() {
    let lora = "  model: {path: /models/base, lora: {rank: 8}}\n  engines: {backend: Builtin}\n";
    refused(
        pool("shared", lora).validate(),
        "model.lora: an EnginePool serves the base model; each run brings its own adapter (docs/lora.md)",
    );
}

#[test]
fn a_pool_runs_the_built_in_engine_only() {
    // vLLM is the engines' default: a pool must say Builtin.
    for engines in ["{}", "{backend: vLLM}"] {
        let spec = format!("  model: {{path: /models/base}}\n  engines: {engines}\n");
        refused(
            pool("shared", &spec).validate(),
            "engines.backend: an EnginePool runs moult's built-in engine",
        );
        let errors = pool("shared", &spec).validate().unwrap_err();
        assert!(
            errors.iter().any(|e| e.contains("docs/lora.md")),
            "{errors:?}"
        );
    }
}

#[test]
fn a_pool_refuses_a_runs_engine_fields() {
    for engines in [
        "{backend: Builtin, poolRef: {name: other}}",
        "{backend: Builtin, weightTransfer: {transport: Tcp}}",
    ] {
        let spec = format!("  model: {{path: /models/base}}\n  engines: {engines}\n");
        refused(
            pool("shared", &spec).validate(),
            "engines.poolRef and engines.weightTransfer are a run's fields",
        );
    }
}

#[test]
fn adapters_and_rank_are_bounded() {
    for (extra, message) in [
        (
            "  maxAdapters: 0\n",
            "spec.maxAdapters in body should be greater than or equal to 1",
        ),
        (
            "  maxAdapters: 65\n",
            "spec.maxAdapters in body should be less than or equal to 64",
        ),
        (
            "  maxRank: 0\n",
            "spec.maxRank in body should be greater than or equal to 1",
        ),
        (
            "  maxRank: 513\n",
            "spec.maxRank in body should be less than or equal to 512",
        ),
    ] {
        refused(
            pool("shared", &format!("{BASE}{extra}")).validate(),
            message,
        );
    }
    let most = pool(
        "shared",
        &format!("{BASE}  maxAdapters: 64\n  maxRank: 512\n"),
    );
    assert_eq!(most.validate(), Ok(()));
}

#[test]
fn pool_names_fit_its_childrens_names() {
    refused(
        pool(&"p".repeat(41), BASE).validate(),
        "EnginePool names are at most 40 characters",
    );
    refused(
        pool("pool.a", BASE).validate(),
        "EnginePool names start with a lowercase letter",
    );
}

#[test]
fn a_run_on_a_pool_with_an_adapter_validates_whatever_its_engines_backend() {
    // The engines' default backend (vLLM) and a CPU trainer: the pool's engines are built-in,
    // and the adapter goes over the TCP stream.
    let r = run(LORA, "{poolRef: {name: shared}}");
    assert_eq!(r.validate(), Ok(()));
    assert_eq!(r.spec.engines.transport(), WeightTransport::Tcp);
    let builtin = run(LORA, "{backend: Builtin, poolRef: {name: shared}}");
    assert_eq!(builtin.validate(), Ok(()));
    // Without a pool, a LoRA run's own vLLM engines load each version from a folder.
    let folder = "{backend: vLLM, weightTransfer: {transport: Filesystem, claimName: w}}";
    assert_eq!(run(LORA, folder).validate(), Ok(()));
    refused(
        run(LORA, "{backend: vLLM}").validate(),
        "model.lora with vLLM engines: each adapter version reaches vLLM as a folder it loads",
    );
}

#[test]
fn a_run_on_a_pool_trains_an_adapter() {
    refused(
        run("{path: /models/base}", "{poolRef: {name: shared}}").validate(),
        "engines.poolRef: a run on an EnginePool trains a LoRA adapter of the pool's base model: set model.lora",
    );
}

#[test]
fn a_run_on_a_pool_has_no_engines_of_its_own() {
    let message = "engines.poolRef: a run on an EnginePool has no engines of its own: leave engines.replicas unset";
    for engines in [
        "{poolRef: {name: shared}, replicas: 3}",
        "{poolRef: {name: shared}, replicas: 0}",
        "{poolRef: {name: shared}, weightTransfer: {transport: Filesystem, claimName: w}}",
    ] {
        refused(run(LORA, engines).validate(), message);
    }
    // The same fields without a pool are the run's own engines'.
    assert_eq!(
        run(LORA, "{backend: Builtin, replicas: 3}").validate(),
        Ok(())
    );
}

#[test]
fn a_pool_ref_names_a_pool() {
    refused(
        run(LORA, "{poolRef: {name: Shared_Pool}}").validate(),
        "engines.poolRef.name names an EnginePool",
    );
    refused(
        run(LORA, &format!("{{poolRef: {{name: {}}}}}", "p".repeat(41))).validate(),
        "spec.engines.poolRef.name: Too long: may not be more than 40 bytes",
    );
}
