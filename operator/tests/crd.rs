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

/// The rule messages docs/operator.md quotes (its list after "The API server rejects what cannot
/// work") are the CRD's: each quoted piece between `...` elisions stands in a rule's message.
#[test]
fn the_rule_messages_the_docs_quote_are_the_crds() {
    let crd = moult_operator::crd_yaml();
    // Messages as the YAML holds them, quotes and line folding aside.
    let crd: String = crd.split_whitespace().collect::<Vec<_>>().join(" ");
    let crd = crd.replace("\\\"", "\"").replace("''", "'");
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operator.md"))
        .unwrap();
    let start = doc
        .find("The API server rejects what cannot work")
        .expect("the docs list the rule messages");
    let list = &doc[start..start + doc[start..].find("\n\nplus ").unwrap()];
    let mut quoted = 0;
    for item in list.split('`').skip(1).step_by(2) {
        // Flag names and field paths quoted in the prose are not messages.
        if !item.contains(' ') {
            continue;
        }
        for piece in item.split("...") {
            let piece = piece.trim().trim_end_matches([':', ',']).trim();
            if piece.len() >= 20 {
                quoted += 1;
                assert!(
                    crd.contains(piece),
                    "docs/operator.md quotes a message the CRD does not have: {piece:?}"
                );
            }
        }
    }
    assert!(quoted >= 20, "{quoted} quoted messages");
}
