//! The built-in `math` env (docs/agents.md): its Python tests on the real math-verify (answer
//! extraction and equivalence over tests/fixtures/math_answers.jsonl, the JSON-lines protocol),
//! and `agent.env: math` as moult runs it: the embedded `moult.math` module started through the
//! runner by the Rust agent pool's external-env path.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use moult_runtime::agents::env::{builtin_agent, Env};
use moult_runtime::agents::process::ExternalEnv;
use moult_runtime::agents::Agent;
use serde_json::json;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

#[test]
fn math_env_python_tests_pass_on_the_real_math_verify() {
    let out = Command::new(common::python())
        .arg(repo().join("tests/python/test_math_env.py"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn agent_env_math_runs_the_embedded_module_and_checks_equivalence() {
    let Agent::ExternalEnv(mut cmd) = builtin_agent("math").unwrap() else {
        panic!("math is an external env")
    };
    // A run starts `python3` from PATH; here the test environment's, which has math-verify.
    assert_eq!(cmd.program, "python3");
    assert_eq!(cmd.args, ["-m", "moult.runner", "run", "moult.math"]);
    cmd.program = common::python().to_string_lossy().into_owned();
    let mut env = ExternalEnv::spawn(&cmd).await.unwrap();
    let task = json!({"question": "Half of 3?", "answer": "It is 3/2.\n#### 1.5"});
    let prompt = env.reset(&task).await.unwrap();
    assert!(
        prompt.contains("Half of 3?") && prompt.contains("\\boxed"),
        "{prompt}"
    );
    let step = env
        .step("Half of three is \\frac{3}{2}, so \\boxed{\\frac{3}{2}}.")
        .await
        .unwrap();
    assert_eq!((step.reward, step.terminated), (1.0, true), "{step:?}");
    assert_eq!(step.info["correct"], true);
    env.reset(&task).await.unwrap();
    let wrong = env.step("The answer is 2.").await.unwrap();
    assert_eq!(wrong.reward, 0.0, "{wrong:?}");
    let err = builtin_agent("maths").unwrap_err().to_string();
    assert!(err.contains("available: repeat, math"), "{err}");
}
