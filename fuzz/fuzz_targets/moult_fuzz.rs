//! libFuzzer's entry to every target of the `moult-fuzz` library: `MOULT_FUZZ_TARGET` names the
//! one this process fuzzes (`scripts/fuzz.sh` sets it), so one instrumented build serves all.
#![no_main]

use std::sync::OnceLock;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    static TARGET: OnceLock<fn(&[u8])> = OnceLock::new();
    let target = TARGET.get_or_init(|| {
        let name = std::env::var("MOULT_FUZZ_TARGET")
            .expect("MOULT_FUZZ_TARGET names the target to fuzz (scripts/fuzz.sh)");
        moult_fuzz::target(&name).unwrap_or_else(|| panic!("no fuzz target `{name}`"))
    });
    target(data);
});
