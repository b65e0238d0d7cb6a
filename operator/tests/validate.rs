//! `RLRun::validate` (the CRD's schema and CEL rules evaluated client-side, what the runtime
//! checks every manifest with) refuses the same manifests as the API server, naming the same
//! field with the same message. The cases are the ones
//! `cluster_invalid_manifests_are_rejected_with_their_messages` sends to a real one.

mod support;

use moult_operator::api::{EnginePool, RLRun};
use support::{invalid_cases, small_run};

/// The manifest as the runtime reads it (`moult run`, every pod of a cluster run): serde names
/// the field of a value that is not even of the field's type.
fn parse(yaml: &str) -> Result<RLRun, String> {
    let mut run: RLRun = serde_yaml_ng::from_str(yaml).map_err(|e| e.to_string())?;
    run.metadata.namespace = Some("local".into());
    Ok(run)
}

#[test]
fn the_base_manifest_and_the_cluster_example_are_valid() {
    assert_eq!(parse(&small_run("ok", 1)).unwrap().validate(), Ok(()));
    let doc = support::example_run_yaml();
    assert_eq!(parse(&doc).unwrap().validate(), Ok(()));
}

#[test]
fn every_case_the_api_server_refuses_is_refused_here_naming_the_same_field() {
    let base = small_run("bad", 1);
    let cases = invalid_cases(&base);
    for case in &cases {
        let run = match parse(&case.yaml) {
            Ok(run) => run,
            // A value that does not fit the field's type (a duration that is none, an
            // estimator moult does not know) does not even make an RLRun: serde names the field.
            Err(e) => {
                assert!(
                    !case.field.is_empty() && e.contains(case.field),
                    "{}: the parse error names {}: {e}",
                    case.message,
                    case.field
                );
                continue;
            }
        };
        let errors = run.validate().expect_err(case.message);
        assert!(
            errors
                .iter()
                .any(|e| e.contains(case.message) && e.starts_with(case.field)),
            "{:?} at {:?} among {errors:?}",
            case.message,
            case.field
        );
    }
    assert!(cases.len() >= 20, "{} cases", cases.len());
}

#[test]
fn every_kind_of_run_the_tests_build_is_a_valid_spec() {
    for (kind, run) in support::runs::run_kinds() {
        assert_eq!(run.validate(), Ok(()), "{kind}");
    }
}

/// Every RLRun and EnginePool the repository ships (examples/*/*.yaml) and the manifests the tests build use only
/// fields the schema has: `moult run` and the API server would refuse any other.
#[test]
fn the_shipped_manifests_have_no_unknown_fields() {
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    let (mut seen, mut pools) = (0, 0);
    for dir in std::fs::read_dir(examples).unwrap() {
        for file in std::fs::read_dir(dir.unwrap().path()).into_iter().flatten() {
            let path = file.unwrap().path();
            if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                let value: serde_json::Value = serde::Deserialize::deserialize(doc).unwrap();
                if value["kind"] == "RLRun" {
                    seen += 1;
                    let unknown = RLRun::unknown_fields(&value);
                    assert!(unknown.is_empty(), "{}: {unknown:?}", path.display());
                }
                if value["kind"] == "EnginePool" {
                    pools += 1;
                    let unknown = EnginePool::unknown_fields(&value);
                    assert!(unknown.is_empty(), "{}: {unknown:?}", path.display());
                    let pool: EnginePool = serde_json::from_value(value.clone()).unwrap();
                    assert_eq!(pool.validate(), Ok(()), "{}", path.display());
                }
            }
        }
    }
    assert!(seen >= 9, "{seen} example manifests");
    assert!(pools >= 1, "{pools} example EnginePools");
    for (kind, run) in support::runs::run_kinds() {
        let value = serde_json::to_value(&run).unwrap();
        assert_eq!(
            RLRun::unknown_fields(&value),
            Vec::<String>::new(),
            "{kind}"
        );
    }
}
