//! The CRD's CEL rules evaluated client-side (`RLRun::validate`, for manifests that never meet an
//! API server) refuse the same manifests as the API server, with the same messages. The cases
//! are the ones `cluster_invalid_manifests_are_rejected_with_their_messages` sends to a real one.

mod support;

use moult_operator::api::RLRun;
use support::{invalid_cases, small_run, Rule};

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
fn every_cel_rule_refuses_its_case_with_the_api_servers_message() {
    let base = small_run("bad", 1);
    let mut checked = 0;
    for (yaml, message, rule) in invalid_cases(&base) {
        if rule != Rule::Cel {
            continue;
        }
        let run = match parse(&yaml) {
            Ok(run) => run,
            // A timeout that is no duration does not even make an RLRun here; serde names the field.
            Err(e) => {
                assert!(
                    message.starts_with("agent.timeout") && e.contains("spec.agent.timeout"),
                    "{message}: {e}"
                );
                checked += 1;
                continue;
            }
        };
        let errors = run.validate().expect_err(message);
        assert!(
            errors.iter().any(|e| e.contains(message)),
            "{message:?} among {errors:?}"
        );
        checked += 1;
    }
    assert!(checked >= 10, "{checked} CEL cases");
}
