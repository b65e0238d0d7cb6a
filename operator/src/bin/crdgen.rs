//! Writes moult's CustomResourceDefinitions: both to stdout, or each file named as an argument
//! the CRD its file name says (`rlrun.yaml`, `enginepool.yaml`):
//! `cargo run -p moult-operator --bin crdgen -- crds/rlrun.yaml crds/enginepool.yaml charts/moult-operator/crds/rlrun.yaml charts/moult-operator/crds/enginepool.yaml`.
//! The committed copies must equal this output; a test checks them.
use std::io::Write;
use std::path::Path;

fn main() {
    let paths: Vec<String> = std::env::args().skip(1).collect();
    if paths.is_empty() {
        let both = format!(
            "{}---\n{}",
            moult_operator::crd_yaml(),
            moult_operator::pool_crd_yaml()
        );
        std::io::stdout()
            .write_all(both.as_bytes())
            .expect("stdout");
    }
    for path in paths {
        let file = Path::new(&path).file_name().and_then(|f| f.to_str());
        let yaml = match file {
            Some("rlrun.yaml") => moult_operator::crd_yaml(),
            Some("enginepool.yaml") => moult_operator::pool_crd_yaml(),
            _ => {
                eprintln!(
                    "crdgen: {path}: the file name says which CRD: rlrun.yaml or enginepool.yaml"
                );
                std::process::exit(2)
            }
        };
        std::fs::write(&path, &yaml).unwrap_or_else(|e| {
            eprintln!("crdgen: cannot write {path}: {e}");
            std::process::exit(1)
        });
    }
}
