//! The vLLM engine pods' command line, judged by the pinned vLLM itself: every flag the operator
//! generates goes through vLLM's own argument parser and validation (tests/python/
//! vllm_check_args.py, run by the vLLM virtualenv of scripts/setup-vllm.sh), so a flag that
//! vLLM renamed, dropped or refuses fails here and not on a user's GPU node.
//!
//! Needs `MOULT_VLLM_PYTHON` (scripts/test.sh sets it); without it the tests fail with the
//! command that installs vLLM.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use moult_operator::api::{EngineBackend, RLRun};
use moult_operator::children::{desired, Config};

fn vllm_python() -> PathBuf {
    let python = std::env::var_os("MOULT_VLLM_PYTHON").unwrap_or_else(|| {
        panic!(
            "MOULT_VLLM_PYTHON is not set: install the pinned vLLM with `bash scripts/setup-vllm.sh` \
             and set it to the python that prints (scripts/test.sh does both)"
        )
    });
    PathBuf::from(python)
}

fn example_run() -> RLRun {
    let doc = support::example_run_yaml();
    let mut run: RLRun = serde_yaml_ng::from_str(&doc).expect("the example parses");
    run.metadata.namespace = Some("research".into());
    run.metadata.uid = Some("0b1c6a52-5d1e-4f2a-9a55-7f3a1f6c1e01".into());
    run
}

/// The engine container's command and arguments, as the operator makes them.
fn engine_command(run: &RLRun) -> (Vec<String>, Vec<String>) {
    let children = desired(run, &Config::default(), "token").expect("the run builds");
    let pod = children.engines.unwrap().spec.template.spec.unwrap();
    let c = &pod.containers[0];
    (
        c.command.clone().unwrap_or_default(),
        c.args.clone().unwrap_or_default(),
    )
}

/// vLLM's verdict on `args` (what follows `vllm serve`): Ok, or its message.
fn vllm_accepts(args: &[String]) -> Result<(), String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/vllm_check_args.py");
    let out = Command::new(vllm_python())
        .arg(script)
        .args(args)
        .output()
        .expect("the vLLM python runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
        Ok(())
    } else {
        Err(stderr.lines().rev().take(3).collect::<Vec<_>>().join(" | "))
    }
}

#[test]
fn vllm_accepts_the_engine_command_line_the_operator_generates() {
    let mut run = example_run();
    run.spec.engines.backend = EngineBackend::Vllm;
    for replay in [false, true] {
        run.spec.routing_replay = replay;
        let (command, args) = engine_command(&run);
        assert_eq!(command, ["vllm", "serve"], "the image's own entrypoint");
        for needed in [
            "--enable-scale-out",
            "--weight-transfer-config",
            "--logprobs-mode",
        ] {
            assert!(args.iter().any(|a| a == needed), "{needed} in {args:?}");
        }
        assert_eq!(
            args.iter().any(|a| a == "--enable-return-routed-experts"),
            replay
        );
        if let Err(why) = vllm_accepts(&args) {
            panic!("vLLM refuses the operator's engine command line {args:?}: {why}");
        }
    }
}

#[test]
fn vllm_accepts_the_command_line_of_the_filesystem_transport_and_of_moult_run() {
    use moult_operator::api::{WeightTransferSpec, WeightTransport};
    use moult_operator::children::{vllm_args, EngineRole};
    let mut run = example_run();
    run.spec.engines.weight_transfer = Some(WeightTransferSpec {
        transport: WeightTransport::Filesystem,
        claim_name: Some("rl-weights".into()),
    });
    let (_, args) = engine_command(&run);
    assert!(
        !args.iter().any(|a| a == "--weight-transfer-config"),
        "{args:?}"
    );
    if let Err(why) = vllm_accepts(&args) {
        panic!("vLLM refuses the Filesystem transport's command line {args:?}: {why}");
    }
    // `moult run`'s vLLM processes: the same arguments on a loopback port.
    let local = vllm_args(
        &run.spec,
        "/models/Qwen3-8B",
        "127.0.0.1",
        41234,
        "local",
        EngineRole::Policy,
    );
    assert_eq!(
        local[..5],
        ["/models/Qwen3-8B", "--host", "127.0.0.1", "--port", "41234"]
    );
    if let Err(why) = vllm_accepts(&local) {
        panic!("vLLM refuses moult run's command line {local:?}: {why}");
    }
}

/// A LoRA run on vLLM engines: LoRA on, two adapters at once (a version and the next while the
/// run switches), the rank rounded up to one vLLM takes; vLLM's parser takes it.
#[test]
fn vllm_accepts_the_command_line_of_a_lora_run() {
    use moult_operator::api::{LoraSpec, WeightTransferSpec, WeightTransport};
    let mut run = example_run();
    run.spec.engines.weight_transfer = Some(WeightTransferSpec {
        transport: WeightTransport::Filesystem,
        claim_name: Some("rl-weights".into()),
    });
    run.spec.model.lora =
        Some(serde_json::from_value::<LoraSpec>(serde_json::json!({"rank": 12})).unwrap());
    assert_eq!(run.validate(), Ok(()));
    let (_, args) = engine_command(&run);
    let after = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .map(|i| args[i + 1].as_str())
    };
    assert!(args.iter().any(|a| a == "--enable-lora"), "{args:?}");
    assert_eq!(
        (after("--max-loras"), after("--max-lora-rank")),
        (Some("2"), Some("16"))
    );
    if let Err(why) = vllm_accepts(&args) {
        panic!("vLLM refuses a LoRA run's command line {args:?}: {why}");
    }
}

#[test]
fn vllm_refuses_a_flag_it_does_not_know_so_the_check_can_fail() {
    let mut run = example_run();
    run.spec.engines.backend = EngineBackend::Vllm;
    run.spec.engines.extra_args = vec!["--no-such-flag".into(), "1".into()];
    let (_, args) = engine_command(&run);
    let why = vllm_accepts(&args).expect_err("an unknown flag must be refused");
    assert!(why.contains("--no-such-flag"), "{why}");
}

/// Every option string `vllm serve` takes.
fn vllm_flags() -> Vec<String> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/vllm_check_args.py");
    let out = Command::new(vllm_python())
        .arg(script)
        .arg("--print-flags")
        .output()
        .expect("the vLLM python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with('-'))
        .map(String::from)
        .collect()
}

/// vLLM's parser takes any unique prefix of a flag (argparse's `allow_abbrev`) and `_` for `-`, so
/// `--served-model x` would override the `--served-model-name` moult sets: the CRD refuses every
/// abbreviation of a flag moult sets, and no flag of vLLM's own beyond those.
#[test]
fn vllm_takes_abbreviations_of_the_flags_moult_sets_and_the_crd_refuses_them_alone() {
    use moult_operator::api::RESERVED_ENGINE_FLAGS;
    let refused = |extra: &[String]| {
        let mut run = example_run();
        run.spec.engines.extra_args = extra.to_vec();
        run.validate()
            .err()
            .into_iter()
            .flatten()
            .find(|e| e.contains("cannot set a flag moult sets itself"))
    };
    for (abbreviation, flag) in [
        (&["--served-model", "other"][..], "--served-model-name"),
        (&["--served_model=other"], "--served-model-name"),
        (&["--tensor-parallel", "4"], "--tensor-parallel-size"),
        (&["-t", "4"], "-tp"),
        (&["--max-model", "128"], "--max-model-len"),
        (&["--logprobs-m", "raw_logprobs"], "--logprobs-mode"),
    ] {
        let extra: Vec<String> = abbreviation.iter().map(|s| s.to_string()).collect();
        let mut run = example_run();
        run.spec.engines.extra_args = extra.clone();
        let (_, args) = engine_command(&run);
        if let Err(why) = vllm_accepts(&args) {
            panic!("vLLM was expected to take the abbreviation {extra:?}: {why}");
        }
        let why = refused(&extra).unwrap_or_else(|| panic!("{extra:?} is not refused"));
        assert!(
            why.contains(&format!("moult sets itself: {flag} ")),
            "the message names {flag}: {why}"
        );
    }
    let flags = vllm_flags();
    assert!(flags.len() > 100, "{} flags", flags.len());
    let (reserved, others): (Vec<String>, Vec<String>) = flags.into_iter().partition(|f| {
        RESERVED_ENGINE_FLAGS
            .iter()
            .any(|r| r.starts_with(f.as_str()))
    });
    for flag in &reserved {
        assert!(refused(std::slice::from_ref(flag)).is_some(), "{flag}");
    }
    // The rest in batches (extraArgs holds at most 128): none is refused as a flag moult sets.
    for batch in others.chunks(100) {
        if let Some(why) = refused(batch) {
            panic!("a flag of vLLM's own is refused: {why}\namong {batch:?}");
        }
    }
}
