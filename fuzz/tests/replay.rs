//! Every file of every target's seed corpus (`fuzz/corpus/<target>/`), run through its target on
//! stable Rust: what CI runs of the coverage-guided fuzzing (docs/security.md, "Fuzzing"). The
//! inputs of findings are added to the corpus when they are fixed, so they stay fixed.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

#[test]
fn every_corpus_input_passes_its_target() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut failures = Vec::new();
    println!("{:<20} | {:>6}", "target", "inputs");
    for (name, target) in moult_fuzz::TARGETS {
        let dir = corpus.join(name);
        let mut files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{}: {e} (every target has a seed corpus)", dir.display()))
            .map(|e| e.expect("a corpus entry").path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{} holds no seed", dir.display());
        for file in &files {
            let data = std::fs::read(file).expect("read a corpus file");
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| target(&data))) {
                let why = (panic.downcast_ref::<String>().cloned())
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                failures.push(format!("{name}: {}: {why}", file.display()));
            }
        }
        println!("{name:<20} | {:>6}", files.len());
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The episode seeds reach the trainer's forward and the network round trip, not only the
    // parser (python fuzz/make_seeds.py writes them again when the types change).
    use std::sync::atomic::Ordering;
    let forwards = moult_fuzz::episode::FORWARDS.load(Ordering::Relaxed);
    let round_trips = moult_fuzz::episode::ROUND_TRIPS.load(Ordering::Relaxed);
    assert!(
        forwards >= 3,
        "{forwards} episode_forward seeds reached the forward"
    );
    assert!(
        round_trips >= 2,
        "{round_trips} episode_json seeds made the round trip"
    );
}
