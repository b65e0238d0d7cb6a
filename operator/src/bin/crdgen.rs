//! Writes the RLRun CustomResourceDefinition to stdout, or to the file named by its argument
//! (`cargo run -p moult-operator --bin crdgen -- crds/rlrun.yaml`). The committed YAML must equal
//! this output; a test checks it.
use std::io::Write;

fn main() {
    let yaml = moult_operator::crd_yaml();
    match std::env::args().nth(1) {
        Some(path) => std::fs::write(&path, yaml).unwrap_or_else(|e| {
            eprintln!("crdgen: cannot write {path}: {e}");
            std::process::exit(1)
        }),
        None => std::io::stdout()
            .write_all(yaml.as_bytes())
            .expect("stdout"),
    }
}
