//! The committed CRD is the generated one.

#[test]
fn committed_crd_matches_crdgen() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../crds/rlrun.yaml");
    let committed = std::fs::read_to_string(path).expect("crds/rlrun.yaml exists");
    assert!(
        committed == moult_operator::crd_yaml(),
        "crds/rlrun.yaml is stale: run `cargo run -p moult-operator --bin crdgen -- crds/rlrun.yaml`"
    );
}
