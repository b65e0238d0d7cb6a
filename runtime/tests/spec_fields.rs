//! docs/spec-fields.md against the code: every field of the CRD's spec has a row, and the rows
//! `moult run` does not honour ("named, not used") are exactly what its "set for a cluster, not
//! used here" line names (`config::cluster_only_fields`), so no field is ignored without a word.

use moult_operator::api::RLRun;
use moult_runtime::config::cluster_only_fields;

/// (fields of a row's first cell, its `moult run` cell). `algorithm.estimator`, `groupSize`
/// means `algorithm.groupSize`; `eval.dataset.*` covers what is under `eval.dataset`.
fn rows() -> Vec<(Vec<String>, String)> {
    let doc = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../docs/spec-fields.md"
    ))
    .unwrap();
    let mut rows = Vec::new();
    for line in doc.lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split(" | ").collect();
        // "(but `claimName`)": those have rows of their own.
        let mut named = cells[0].to_string();
        while let Some(i) = named.find("(but") {
            let end = i + named[i..].find(')').unwrap();
            named.replace_range(i..=end, "");
        }
        let mut parent = String::new();
        let mut fields = Vec::new();
        for name in named.split('`').skip(1).step_by(2) {
            let full = if name.contains('.') {
                parent = name.rsplit_once('.').unwrap().0.to_string();
                name.to_string()
            } else if parent.is_empty() {
                name.to_string()
            } else {
                format!("{parent}.{name}")
            };
            fields.push(full);
        }
        rows.push((fields, cells[1].to_string()));
    }
    assert!(rows.len() >= 30, "{} rows", rows.len());
    rows
}

fn covers(row: &str, path: &str) -> bool {
    let row = row.trim_end_matches(".*");
    path == row || path.starts_with(&format!("{row}."))
}

/// The spec's fields, as paths below `spec`: objects with properties are walked, anything else
/// (lists, maps, embedded Kubernetes types' insides) is one field.
fn schema_fields(schema: &serde_json::Value, path: &str, out: &mut Vec<String>) {
    match schema.get("properties").and_then(|p| p.as_object()) {
        Some(props) if !path.ends_with("resources") => {
            for (key, sub) in props {
                let at = if path.is_empty() {
                    key.clone()
                } else {
                    format!("{path}.{key}")
                };
                schema_fields(sub, &at, out);
            }
        }
        _ => out.push(path.to_string()),
    }
}

#[test]
fn every_spec_field_has_a_row() {
    let spec = &moult_operator::rlrun_schema()["properties"]["spec"];
    let mut fields = Vec::new();
    schema_fields(spec, "", &mut fields);
    assert!(fields.len() > 60, "{fields:?}");
    let rows = rows();
    let missing: Vec<&String> = fields
        .iter()
        .filter(|f| {
            !rows
                .iter()
                .any(|(names, _)| names.iter().any(|n| covers(n, f)))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "fields docs/spec-fields.md has no row for: {missing:?}"
    );
}

/// A manifest that sets every field `moult run` does not use.
const EVERYTHING_FOR_A_CLUSTER: &str = r#"
apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {name: all}
spec:
  model: {path: model, claimName: models}
  agent:
    env: repeat
    image: agents:1
    replicas: 4
    resources: {limits: {cpu: 2}}
    egress: {to: [{cidr: 10.0.0.0/8}]}
    readOnlyRootFilesystem: false
    runtimeClassName: gvisor
    sandbox: {image: "python:3.13-slim", warmPool: 8}
    dataset: {path: tasks.jsonl, claimName: data}
  eval: {dataset: {path: held-out.jsonl, claimName: data}}
  engines:
    backend: Builtin
    extraArgs: ["--max-batch", "16"]
    image: engine:1
    gpusPerEngine: 1
    resources: {limits: {cpu: 2}}
    weightTransfer: {transport: Filesystem, claimName: weights}
  trainer: {image: trainer:1, resources: {limits: {cpu: 2}}, terminationGracePeriodSeconds: 300}
  coordinator: {resources: {limits: {memory: 16Gi}}, agentLimits: {generations: 8}}
  algorithm: {teacher: {path: teacher, claimName: teachers, replicas: 2}}
  judge: {path: judge, claimName: judges, replicas: 2, prompt: "Is {response} right?"}
  checkpoint: {claimName: ckpt}
  scheduling: {queueName: team-a}
  suspend: true
  totalSteps: 1
"#;

#[test]
fn the_not_used_rows_are_what_moult_run_names() {
    let run: RLRun = serde_yaml_ng::from_str(EVERYTHING_FOR_A_CLUSTER).unwrap();
    assert_eq!(run.validate(), Ok(()));
    let named: Vec<&str> = cluster_only_fields(&run.spec)
        .into_iter()
        .map(|f| f.split(" (").next().unwrap())
        .collect();
    let rows = rows();
    // Each row that says "named, not used" (in a case the manifest above makes) is named by
    // moult run.
    for (fields, local) in &rows {
        if local.contains("named, not used") {
            for f in fields {
                assert!(
                    named.iter().any(|n| covers(n, f) || covers(f, n)),
                    "docs/spec-fields.md says moult run names {f}; it named {named:?}"
                );
            }
        }
    }
    // And everything moult run names has a row that says so.
    for n in &named {
        assert!(
            rows.iter()
                .any(|(fields, local)| local.contains("named, not used")
                    && fields.iter().any(|f| covers(n, f) || covers(f, n))),
            "moult run names {n}, which no row of docs/spec-fields.md calls \"named, not used\""
        );
    }
}
