//! `moult-jail`: the small binary that makes the jails (lib.rs says what a jail is). `moult`
//! could make them itself, but a `moult` linked to libtorch takes ~0.4 s to start, paid per
//! episode; this one starts in about a millisecond (docs/benchmarks.md, "Episodes").

fn main() {
    moult_jail::run_if_asked();
    eprintln!("moult-jail makes the jails of moult's agent programs; moult starts it, with their plan in MOULT_JAIL or MOULT_SANDBOX_RUN (docs/security.md#episodes)");
    std::process::exit(2);
}
