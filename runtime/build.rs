//! Compiles the C++ shim of the trainer's CPU collectives (`csrc/gloo_shim.cpp`: libtorch's c10d
//! Gloo process group) when the `torch` feature is on. c10d's Gloo header includes Gloo's own
//! headers, which PyPI's torch does not ship: they come from the system (Debian's `libgloo-dev`,
//! or `GLOO_INCLUDE_DIR`). Without them the shim is skipped and a multi-rank trainer says what is
//! missing (docs/distributed.md).
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=csrc/gloo_shim.cpp");
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE_DIR");
    println!("cargo::rustc-check-cfg=cfg(moult_gloo)");
    if std::env::var_os("CARGO_FEATURE_TORCH").is_none() {
        return;
    }
    let Some(libtorch_lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from) else {
        println!("cargo:warning=torch-sys did not say where libtorch is: the Gloo collectives are not built");
        return;
    };
    let gloo = std::env::var_os("GLOO_INCLUDE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/include"));
    if !gloo.join("gloo/context.h").exists() {
        println!(
            "cargo:warning=Gloo headers not found in {} (apt-get install libgloo-dev, or set GLOO_INCLUDE_DIR): a trainer of more than one rank will refuse to start (docs/distributed.md)",
            gloo.display()
        );
        return;
    }
    let include = libtorch_lib
        .parent()
        .expect("libtorch's lib dir has a parent")
        .join("include");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .std("c++17")
        .define("USE_C10D_GLOO", None)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(&gloo)
        .file("csrc/gloo_shim.cpp")
        .compile("moult_gloo_shim");
    println!("cargo:rustc-cfg=moult_gloo");
}
