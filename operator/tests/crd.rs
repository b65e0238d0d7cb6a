//! The committed CRDs (and the Helm chart's copies) are the generated ones.

const REGENERATE: &str = "cargo run -p moult-operator --bin crdgen -- crds/rlrun.yaml crds/enginepool.yaml charts/moult-operator/crds/rlrun.yaml charts/moult-operator/crds/enginepool.yaml";

#[test]
fn committed_crds_match_crdgen() {
    for dir in ["crds", "charts/moult-operator/crds"] {
        for (file, crd) in [
            ("rlrun.yaml", moult_operator::crd_yaml()),
            ("enginepool.yaml", moult_operator::pool_crd_yaml()),
        ] {
            let path = format!("{dir}/{file}");
            let full = format!("{}/../{path}", env!("CARGO_MANIFEST_DIR"));
            let committed =
                std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("{path}: {e}"));
            assert!(committed == crd, "{path} is stale: run `{REGENERATE}`");
        }
    }
}

/// The EnginePool CRD as the API server gets it: namespaced, the scale subresource on the
/// engines' replicas with the status' ready engines and selector, the status subresource, and
/// every string and list of its spec bounded (the CEL rules' cost).
#[test]
fn the_pool_crd_scales_its_engines_and_bounds_its_spec() {
    let crd = moult_operator::pool_crd_json();
    assert_eq!(crd["metadata"]["name"], "enginepools.moult.dev");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
    let version = &crd["spec"]["versions"][0];
    let scale = &version["subresources"]["scale"];
    assert_eq!(scale["specReplicasPath"], ".spec.engines.replicas");
    assert_eq!(scale["statusReplicasPath"], ".status.replicas");
    assert_eq!(scale["labelSelectorPath"], ".status.selector");
    assert!(version["subresources"]["status"].is_object());
    let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
    assert_eq!(spec["properties"]["maxAdapters"]["default"], 8);
    assert_eq!(spec["properties"]["maxRank"]["maximum"], 512.0);
    let engines = &spec["properties"]["engines"]["properties"];
    assert_eq!(engines["image"]["maxLength"], 1024);
    assert_eq!(engines["poolRef"]["properties"]["name"]["maxLength"], 40);
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        columns,
        ["Ready", "Engines", "Runs", "Age", "Reason", "Message"]
    );
}

/// The rule messages docs/operator.md quotes (its list after "The API server rejects what cannot
/// work") are the CRDs': each quoted piece between `...` elisions stands in a rule's message.
#[test]
fn the_rule_messages_the_docs_quote_are_the_crds() {
    let crd = moult_operator::crd_yaml() + &moult_operator::pool_crd_yaml();
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
