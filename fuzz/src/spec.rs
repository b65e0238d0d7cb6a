//! RLRun manifests (YAML, from a user or a GitOps repository): `moult run`'s reading and the
//! operator's building of a run's children.

use moult_operator::api::RLRun;
use moult_operator::children::{desired, Config};
use serde_json::Value as Json;

/// Whether `name` is one the API server admits for an object (a DNS-1123 subdomain).
fn admitted_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        })
}

/// A manifest is refused naming the field (unknown fields, types, the CRD's rules), or it builds
/// every child object without a panic: refused by the operator naming the field, or built.
pub fn manifest(data: &[u8]) {
    let Some(text) = crate::text(data) else {
        return;
    };
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let Ok(mut value) = <Json as serde::Deserialize>::deserialize(doc) else {
            return;
        };
        if value.get("kind").and_then(Json::as_str) != Some("RLRun")
            || !RLRun::unknown_fields(&value).is_empty()
        {
            continue;
        }
        // What the API server guarantees of a stored object: a name it admits, a namespace.
        let name = value.pointer("/metadata/name").and_then(Json::as_str);
        if !name.is_some_and(admitted_name) {
            value["metadata"] = serde_json::json!({"name": "run"});
        }
        value["metadata"]["namespace"] = "fuzz".into();
        let Ok(run) = serde_json::from_value::<RLRun>(value) else {
            continue;
        };
        if run.validate().is_err() {
            continue;
        }
        if let Ok(children) = desired(&run, &Config::default(), "token") {
            assert!(!children.into_list().is_empty());
        }
    }
}
