//! Compiles the C++ shim of the trainer's collectives (`csrc/c10d_shim.cpp`: libtorch's c10d,
//! Gloo for CPU tensors and, with the `cuda` feature, NCCL for CUDA tensors) when the `torch`
//! feature is on.
//!
//! - c10d's Gloo header includes Gloo's own headers, which PyPI's torch does not ship: they come
//!   from the system (Debian's `libgloo-dev`, or `GLOO_INCLUDE_DIR`). Without them the shim is
//!   skipped and a multi-rank trainer says what is missing.
//! - c10d's NCCL header includes CUDA's runtime headers and `nccl.h`. PyPI's CUDA build of torch
//!   brings the runtime headers and NCCL's; `nvidia-cuda-crt` and `nvidia-cuda-cccl` add the two
//!   folders the runtime headers include (or point `CUDA_INCLUDE_DIR` at a CUDA toolkit's).
//!   Without them the shim is built for Gloo only and GPU ranks say what is missing.
//!
//! docs/distributed.md says how to install each.
use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=csrc/c10d_shim.cpp");
    println!("cargo:rerun-if-env-changed=GLOO_INCLUDE_DIR");
    println!("cargo:rerun-if-env-changed=CUDA_INCLUDE_DIR");
    println!("cargo::rustc-check-cfg=cfg(moult_gloo)");
    println!("cargo::rustc-check-cfg=cfg(moult_nccl)");
    if std::env::var_os("CARGO_FEATURE_TORCH").is_none() {
        return;
    }
    let Some(libtorch_lib) = std::env::var_os("DEP_TCH_LIBTORCH_LIB").map(PathBuf::from) else {
        println!("cargo:warning=torch-sys did not say where libtorch is: the trainer's collectives are not built");
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
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .std("c++17")
        .define("USE_C10D_GLOO", None)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(&gloo);
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        match cuda_includes(&libtorch_lib) {
            Ok(dirs) => {
                build
                    .define("USE_C10D_NCCL", None)
                    .define("USE_CUDA", None)
                    .define("MOULT_NCCL", None);
                for dir in dirs {
                    build.include(dir);
                }
                println!("cargo:rustc-link-lib=dylib=torch_cuda");
                println!("cargo:rustc-link-lib=dylib=c10_cuda");
                println!("cargo:rustc-cfg=moult_nccl");
            }
            Err(missing) => println!(
                "cargo:warning=CUDA headers not found ({missing}; pip install nvidia-cuda-crt nvidia-cuda-cccl into the torch virtualenv, or set CUDA_INCLUDE_DIR): trainer ranks on GPUs will refuse to start (docs/distributed.md)"
            ),
        }
    }
    build.file("csrc/c10d_shim.cpp").compile("moult_c10d_shim");
    println!("cargo:rustc-cfg=moult_gloo");
}

/// The include folders that hold CUDA's runtime headers, the two folders they include
/// (`crt/`, CCCL's `nv/`) and `nccl.h`: `CUDA_INCLUDE_DIR`, then every `nvidia/*/include`
/// beside PyPI's torch. Names what is missing otherwise.
fn cuda_includes(libtorch_lib: &Path) -> Result<Vec<PathBuf>, String> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("CUDA_INCLUDE_DIR")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    // torch/lib -> torch -> site-packages
    if let Some(site) = libtorch_lib.parent().and_then(Path::parent) {
        if let Ok(entries) = std::fs::read_dir(site.join("nvidia")) {
            let mut found: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path().join("include"))
                .filter(|p| p.is_dir())
                .collect();
            found.sort();
            dirs.extend(found);
        }
    }
    let missing: Vec<&str> = ["cuda_runtime.h", "crt/host_config.h", "nv/target", "nccl.h"]
        .into_iter()
        .filter(|f| !dirs.iter().any(|d| d.join(f).exists()))
        .collect();
    if missing.is_empty() {
        Ok(dirs)
    } else {
        Err(format!("no {}", missing.join(", ")))
    }
}
