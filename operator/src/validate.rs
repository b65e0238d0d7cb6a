//! `RLRun::validate` (and `EnginePool::validate`): what the API server would refuse, checked where there is no API server
//! (`moult run`, and every pod of a cluster run reading its manifest), so that a spec is judged
//! by one set of rules in both places.
//!
//! Two parts, both read from the generated CRD (`crd_json`): the OpenAPI schema's ranges,
//! lengths, item and key counts and enums, with the API server's wording ("spec.totalSteps in body should
//! be greater than or equal to 1"); and the CEL rules (`x-kubernetes-validations`), evaluated by
//! kube's CEL interpreter with each rule's message. Every error names the field path.

use serde_json::Value;

use crate::api::{EnginePool, RLRun};

impl RLRun {
    /// The CRD's schema and CEL rules evaluated here, with the API server's messages: what
    /// `kubectl apply` would refuse, for a manifest that never meets an API server. Each error
    /// names the field path.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        validate(self, crate::rlrun_schema())
    }

    /// The fields of a manifest (the YAML document as a value, before serde drops what it does
    /// not know) that the RLRun schema does not have: what `kubectl apply` refuses under strict
    /// field validation ("unknown field \"spec.rollout.maxToken\""). Each error names the path
    /// and the nearest known field, or the fields its object has when none is near.
    pub fn unknown_fields(manifest: &Value) -> Vec<String> {
        let mut errors = Vec::new();
        unknown_fields(crate::rlrun_schema(), manifest, "", "an RLRun", &mut errors);
        errors
    }
}

impl EnginePool {
    /// The EnginePool CRD's schema and CEL rules evaluated here, as [`RLRun::validate`] does.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        validate(self, crate::pool_schema())
    }

    /// The fields of a manifest that the EnginePool schema does not have, as
    /// [`RLRun::unknown_fields`] names them.
    pub fn unknown_fields(manifest: &Value) -> Vec<String> {
        let mut errors = Vec::new();
        unknown_fields(
            crate::pool_schema(),
            manifest,
            "",
            "an EnginePool",
            &mut errors,
        );
        errors
    }
}

/// A kind of manifest read where there is no API server (`moult run`, `moult pool`, the pods of a
/// cluster run), checked as the API server checks it.
pub trait Manifest: serde::de::DeserializeOwned {
    /// Its `kind`.
    const KIND: &'static str;
    /// [`RLRun::validate`], [`EnginePool::validate`].
    fn check(&self) -> Result<(), Vec<String>>;
    /// [`RLRun::unknown_fields`], [`EnginePool::unknown_fields`].
    fn unknown(manifest: &Value) -> Vec<String>;
}

impl Manifest for RLRun {
    const KIND: &'static str = "RLRun";
    fn check(&self) -> Result<(), Vec<String>> {
        self.validate()
    }
    fn unknown(manifest: &Value) -> Vec<String> {
        Self::unknown_fields(manifest)
    }
}

impl Manifest for EnginePool {
    const KIND: &'static str = "EnginePool";
    fn check(&self) -> Result<(), Vec<String>> {
        self.validate()
    }
    fn unknown(manifest: &Value) -> Vec<String> {
        Self::unknown_fields(manifest)
    }
}

/// `object`'s spec against `schema` (its CRD's), then its CEL rules.
fn validate<K>(object: &K, schema: &Value) -> Result<(), Vec<String>>
where
    K: kube::CustomResourceExt + serde::Serialize,
{
    let value = serde_json::to_value(object).expect("a custom resource serializes");
    let mut errors = Vec::new();
    if let Some(spec) = value.get("spec") {
        schema_errors(&schema["properties"]["spec"], spec, "spec", &mut errors);
    }
    if let Err(cel) = kube::core::cel::validate_cel(object) {
        errors.extend(cel.into_iter().map(|e| e.to_string()));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors)
    }
}

/// ObjectMeta's fields: the CRD gives `metadata` no properties, the API server checks it against
/// ObjectMeta itself.
const OBJECT_META: &[&str] = &[
    "annotations",
    "creationTimestamp",
    "deletionGracePeriodSeconds",
    "deletionTimestamp",
    "finalizers",
    "generateName",
    "generation",
    "labels",
    "managedFields",
    "name",
    "namespace",
    "ownerReferences",
    "resourceVersion",
    "selfLink",
    "uid",
];

/// `kind` names the root object in a hint ("an RLRun has: ...").
fn unknown_fields(schema: &Value, value: &Value, path: &str, kind: &str, errors: &mut Vec<String>) {
    match value {
        Value::Object(fields) => {
            let properties = schema.get("properties").and_then(Value::as_object);
            let mut known: Vec<&str> = properties
                .into_iter()
                .flat_map(|p| p.keys().map(String::as_str))
                .collect();
            match path {
                // Every object has these; the CRD's schema leaves them out.
                "" => known.extend(["apiVersion", "kind", "metadata"]),
                "metadata" => known = OBJECT_META.to_vec(),
                _ => {}
            }
            let open = known.is_empty()
                || schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
            for (key, v) in fields {
                let at = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                match field_schema(schema, key) {
                    // The status is the operator's to write; the API server drops it.
                    _ if at == "status" => {}
                    Some(sub) => unknown_fields(sub, v, &at, kind, errors),
                    None if at == "metadata" => unknown_fields(&Value::Null, v, &at, kind, errors),
                    None if !open && !known.contains(&key.as_str()) => errors.push(format!(
                        "{at}: unknown field; {}",
                        hint(key, &known, path, kind)
                    )),
                    None => {}
                }
            }
        }
        Value::Array(items) => {
            if let Some(sub) = schema.get("items") {
                for (i, v) in items.iter().enumerate() {
                    unknown_fields(sub, v, &format!("{path}[{i}]"), kind, errors);
                }
            }
        }
        _ => {}
    }
}

/// The schema of an object's field `key`: its property, or the map's value schema.
fn field_schema<'a>(schema: &'a Value, key: &str) -> Option<&'a Value> {
    (schema.get("properties").and_then(|p| p.get(key)))
        .or_else(|| schema.get("additionalProperties").filter(|a| a.is_object()))
}

/// "did you mean maxTokens?" for the known field nearest to `key` (a few edits away, case
/// aside), else the object's known fields.
fn hint(key: &str, known: &[&str], path: &str, kind: &str) -> String {
    let distance = |k: &str| strsim::levenshtein(&key.to_lowercase(), &k.to_lowercase());
    let nearest = known
        .iter()
        .map(|k| (distance(k), *k))
        .filter(|(d, k)| *d <= 2.max(k.len() / 3))
        .min();
    match nearest {
        Some((_, k)) => format!("did you mean {k}?"),
        None if path.is_empty() => format!("{kind} has: {}", known.join(", ")),
        None => format!("{path} has: {}", known.join(", ")),
    }
}

/// The schema keywords the API server checks beyond types (serde has checked the types):
/// minimum, maximum, minLength, maxLength, minItems, maxItems, maxProperties and enum, recursively.
fn schema_errors(schema: &Value, value: &Value, path: &str, errors: &mut Vec<String>) {
    let number = |key: &str| schema.get(key).and_then(Value::as_f64);
    if let Some(v) = value.as_f64() {
        if let Some(min) = number("minimum").filter(|min| v < *min) {
            errors.push(format!(
                "{path}: Invalid value: {}: {path} in body should be greater than or equal to {}",
                show(v),
                show(min)
            ));
        }
        if let Some(max) = number("maximum").filter(|max| v > *max) {
            errors.push(format!(
                "{path}: Invalid value: {}: {path} in body should be less than or equal to {}",
                show(v),
                show(max)
            ));
        }
    }
    if let Some(s) = value.as_str() {
        let chars = s.chars().count() as f64;
        if let Some(min) = number("minLength").filter(|min| chars < *min) {
            errors.push(format!(
                "{path}: Invalid value: {s:?}: {path} in body should be at least {} chars long",
                show(min)
            ));
        }
        if let Some(max) = number("maxLength").filter(|max| chars > *max) {
            errors.push(format!(
                "{path}: Too long: may not be more than {} bytes",
                show(max)
            ));
        }
        if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
            if !allowed.iter().any(|a| a.as_str() == Some(s)) {
                let list: Vec<String> = allowed.iter().map(|a| a.to_string()).collect();
                errors.push(format!(
                    "{path}: Unsupported value: {s:?}: supported values: {}",
                    list.join(", ")
                ));
            }
        }
    }
    match value {
        Value::Object(fields) => {
            if let Some(max) = number("maxProperties").filter(|max| fields.len() as f64 > *max) {
                errors.push(format!(
                    "{path}: Too many: {}: must have at most {} items",
                    fields.len(),
                    show(max)
                ));
            }
            for (key, v) in fields {
                if let Some(sub) = field_schema(schema, key) {
                    schema_errors(sub, v, &format!("{path}.{key}"), errors);
                }
            }
        }
        Value::Array(items) => {
            if let Some(min) = number("minItems").filter(|min| (items.len() as f64) < *min) {
                errors.push(format!(
                    "{path}: Invalid value: {}: {path} in body should have at least {} items",
                    items.len(),
                    show(min)
                ));
            }
            if let Some(max) = number("maxItems").filter(|max| items.len() as f64 > *max) {
                errors.push(format!(
                    "{path}: Too many: {}: must have at most {} items",
                    items.len(),
                    show(max)
                ));
            }
            if let Some(sub) = schema.get("items") {
                for (i, v) in items.iter().enumerate() {
                    schema_errors(sub, v, &format!("{path}[{i}]"), errors);
                }
            }
        }
        _ => {}
    }
}

/// A number as the API server prints it: whole numbers without a fraction.
fn show(x: f64) -> String {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        format!("{}", x as i64)
    } else {
        x.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(spec: &str) -> RLRun {
        serde_yaml_ng::from_str(&format!(
            "apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {{name: r, namespace: local}}
spec:
  model: {{path: /models/policy}}
  agent: {{env: repeat, dataset: {{path: tasks.jsonl}}}}
{spec}"
        ))
        .unwrap()
    }

    #[test]
    fn schema_ranges_and_lengths_are_refused_with_the_api_servers_words() {
        assert_eq!(run("  totalSteps: 3\n").validate(), Ok(()));
        // Quantities as numbers or strings, as Kubernetes takes them.
        assert_eq!(
            run("  totalSteps: 3\n  engines: {resources: {limits: {cpu: 8, memory: 1.5Gi}, requests: {cpu: '500m'}}}\n")
                .validate(),
            Ok(())
        );
        let errors =
            run("  totalSteps: 0\n  rollout: {temperature: 11}\n  checkpoint: {claimName: ''}\n")
                .validate()
                .unwrap_err();
        for want in [
            "spec.totalSteps: Invalid value: 0: spec.totalSteps in body should be greater than or equal to 1",
            "spec.rollout.temperature in body should be less than or equal to 10",
            "spec.checkpoint.claimName in body should be at least 1 chars long",
        ] {
            assert!(errors.iter().any(|e| e.contains(want)), "{want} among {errors:?}");
        }
    }

    #[test]
    fn unknown_fields_are_named_with_the_nearest_known_one() {
        let value = |spec: &str| -> Value {
            serde_yaml_ng::from_str(&format!(
                "apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {{name: r, labels: {{team: a}}}}
spec:
  model: {{path: /models/policy}}
  agent: {{env: repeat, dataset: {{path: tasks.jsonl}}}}
{spec}"
            ))
            .unwrap()
        };
        assert_eq!(
            RLRun::unknown_fields(&value(
                "  totalSteps: 3\n  scheduling: {nodeSelector: {any-key: x}, tolerations: [{key: k, operator: Exists}]}\n"
            )),
            Vec::<String>::new()
        );
        assert_eq!(
            RLRun::unknown_fields(&value(
                "  rollout: {maxToken: 4}\n  scheduling: {tolerations: [{key: k, efect: NoSchedule}]}\n  totalStep: 3\n"
            )),
            [
                "spec.rollout.maxToken: unknown field; did you mean maxTokens?",
                "spec.scheduling.tolerations[0].efect: unknown field; did you mean effect?",
                "spec.totalStep: unknown field; did you mean totalSteps?",
            ]
        );
        let mut typo = value("");
        typo["metadata"]["nmae"] = "x".into();
        typo["sepc"] = Value::Null;
        typo["spec"]["model"]["adapter"] = serde_json::json!({"rank": 8});
        assert_eq!(
            RLRun::unknown_fields(&typo),
            [
                "metadata.nmae: unknown field; did you mean name?",
                "spec.model.adapter: unknown field; spec.model has: claimName, lora, maxModelLen, path",
                "sepc: unknown field; did you mean spec?"
            ]
        );
    }

    #[test]
    fn show_prints_whole_numbers_without_a_fraction() {
        assert_eq!(show(10.0), "10");
        assert_eq!(show(0.5), "0.5");
        assert_eq!(show(-1.0), "-1");
    }
}
