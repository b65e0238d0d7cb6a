//! The built-in `math` env (docs/agents.md): its Python tests on the real math-verify (answer
//! extraction and equivalence over tests/fixtures/math_answers.jsonl, the JSON-lines protocol),
//! and `agent.env: math` as moult runs it: the embedded `moult.math` module started through the
//! runner by the Rust agent pool's external-env path.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use moult_runtime::agents::env::Env;
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
    let Agent::ExternalEnv(mut cmd) = Agent::builtin("math").unwrap() else {
        panic!("math is an external env")
    };
    // A run starts `python3` from PATH; here the test environment's, which has math-verify.
    assert_eq!(cmd.program, "python3");
    assert_eq!(cmd.args, ["-m", "moult.runner", "run", "moult.math"]);
    cmd.program = common::python().to_string_lossy().into_owned();
    let mut env = ExternalEnv::spawn(&cmd, None).await.unwrap();
    let task = json!({"question": "Half of 3?", "answer": "It is 3/2.\n#### 1.5"});
    let prompt = env.reset(&task).await.unwrap().text();
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
    let err = Agent::builtin("maths").unwrap_err().to_string();
    assert!(err.contains("available: repeat, math"), "{err}");
}

/// A Python Env shows images in its observations (docs/vision.md): `moult.Image`s among strings
/// reach the framework as image parts, in order, and become the user message's images.
#[tokio::test]
async fn a_python_env_shows_images_in_its_observations() {
    let dir = std::env::temp_dir().join(format!("moult-image-env-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let module = dir.join("image_env.py");
    std::fs::write(
        &module,
        r#"import moult

PNG = bytes.fromhex("89504e470d0a1a0a")  # any bytes: the message keeps them as they are

class AgentRunner(moult.Env):
    def reset(self, task):
        return ["Figure:", moult.Image(PNG), "What is x?"]

    def step(self, action):
        return moult.Step(observation=[moult.Image(PNG, "image/jpeg")], reward=1.0, terminated=True)
"#,
    )
    .unwrap();
    let mut cmd =
        moult_runtime::agents::process::AgentCommand::python("python3", module.to_str().unwrap())
            .unwrap();
    cmd.program = common::python().to_string_lossy().into_owned();
    let mut env = ExternalEnv::spawn(&cmd, None).await.unwrap();
    let first = env.reset(&json!({})).await.unwrap().into_message().unwrap();
    assert_eq!(first.content.as_deref(), Some("Figure:What is x?"));
    let images: Vec<_> = first.images().collect();
    assert_eq!(images.len(), 1);
    assert_eq!(images[0].data_url, "data:image/png;base64,iVBORw0KGgo=");
    assert_eq!(
        images[0].sha256,
        "4c4b6a3be1314ab86138bef4314dde022e600960d8689a2c8f8631802d20dab6"
    );
    let step = env.step("x = 2").await.unwrap();
    assert_eq!(step.reward, 1.0);
    let shown = step.observation.into_message().unwrap();
    assert!(shown
        .images()
        .next()
        .unwrap()
        .data_url
        .starts_with("data:image/jpeg;base64,"));
    let _ = std::fs::remove_dir_all(&dir);
}
