//! Writes the RLRun CustomResourceDefinition to stdout, or to each file named as an argument
//! (`cargo run -p moult-operator --bin crdgen -- crds/rlrun.yaml charts/moult-operator/crds/rlrun.yaml`).
//! The committed copies must equal this output; a test checks them.
use std::io::Write;

fn main() {
    let yaml = moult_operator::crd_yaml();
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        std::io::stdout()
            .write_all(yaml.as_bytes())
            .expect("stdout");
    }
    for path in paths {
        std::fs::write(&path, &yaml).unwrap_or_else(|e| {
            eprintln!("crdgen: cannot write {path}: {e}");
            std::process::exit(1)
        });
    }
}
