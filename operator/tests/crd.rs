//! The committed CRD (and the Helm chart's copy) is the generated one.

const REGENERATE: &str = "cargo run -p moult-operator --bin crdgen -- crds/rlrun.yaml charts/moult-operator/crds/rlrun.yaml";

#[test]
fn committed_crds_match_crdgen() {
    for path in ["crds/rlrun.yaml", "charts/moult-operator/crds/rlrun.yaml"] {
        let full = format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"));
        let committed = std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(
            committed == moult_operator::crd_yaml(),
            "{path} is stale: run `{REGENERATE}`"
        );
    }
}
