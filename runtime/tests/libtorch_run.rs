//! `moult run` end to end on the README's main recipe (examples/successor): the real binary reads
//! the real manifest, runs the built-in engine, router, Python Env agents, rollout pool, trainer
//! and weight sync, and the policy learns. A run killed with SIGKILL resumes from its last
//! checkpoint and finishes with every step trained once and versions that only increase. And the
//! cluster roles as processes, where an agent's forged episodes never stop the trainer.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The recipe's base model, made by its own script (which skips the work when it is current).
fn recipe() -> PathBuf {
    let dir = repo().join("examples/successor");
    let status = Command::new(common::python())
        .arg(dir.join("make_model.py"))
        .arg(dir.join("model"))
        .status()
        .expect("run make_model.py");
    assert!(status.success(), "make_model.py failed");
    dir.join("rlrun.yaml")
}

fn out_dir(name: &str) -> PathBuf {
    let dir =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("run-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn metrics(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics lines are JSON"))
        .collect()
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let v: Vec<f64> = xs.collect();
    v.iter().sum::<f64>() / v.len() as f64
}

/// The main recipe learns, and its evaluation on held-out tasks (spec.eval: before step 1, every
/// 20 steps, after the last) starts near the base policy's score and rises, on tasks that never
/// appear in a trained batch.
#[test]
fn libtorch_run_learns_the_main_recipe() {
    let manifest = recipe();
    let out = out_dir("learns");
    let status = common::moult()
        .arg("run")
        .arg(&manifest)
        .args(["--out".as_ref(), out.as_os_str()])
        .args(["--steps", "40", "--seed", "1", "--quiet", "--dump-rollouts"])
        .status()
        .unwrap();
    assert!(status.success());
    let steps = metrics(&out);
    assert_eq!(steps.len(), 40);
    let reward = |r: &Value| r["reward_mean"].as_f64().unwrap();
    let first = mean(steps[..3].iter().map(reward));
    let last = mean(steps[steps.len() - 3..].iter().map(reward));
    eprintln!("reward: first 3 steps {first:.3}, last 3 steps {last:.3}");
    assert!(first <= 0.4, "the base policy is at chance: {first}");
    assert!(
        last >= first + 0.4,
        "the reward rose well above its start: {first:.3} -> {last:.3}"
    );
    assert_eq!(
        steps[0]["staleness"],
        serde_json::json!({"0": steps[0]["sampled_tokens"]})
    );
    for (i, r) in steps.iter().enumerate() {
        assert_eq!(r["step"].as_u64(), Some(i as u64 + 1));
        assert_eq!(r["policy_version"].as_u64(), Some(i as u64 + 1));
        // Engine and trainer agree (forward consistency): on tokens sampled by the policy being
        // trained (staleness 0, the first step of an asynchronous run) |log ρ| is rounding only.
        // On stale tokens it measures how far one update moved the policy, which is largest
        // while the reward climbs (0.3–0.6 seen): bounded loosely, it still catches a mismatch
        // (a wrong template or weights give several nats).
        let log_rho = r["mean_abs_log_rho"].as_f64().unwrap();
        let on_policy = r["staleness"].as_object().unwrap().keys().all(|k| k == "0");
        assert!(log_rho < if on_policy { 1e-4 } else { 1.5 }, "{r}");
        assert_busy_fractions(r);
    }
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 40);
    let svg = std::fs::read_to_string(out.join("reward.svg")).unwrap();
    assert!(svg.starts_with("<svg"));
    check_evaluations(&out, &steps, first);
    let _ = std::fs::remove_dir_all(&out);
}

/// The recipe's evaluations: at steps 0, 20 and 40 (16 held-out tasks × 4 samples), the first
/// near the base policy's training reward and the last well above it; each carried by the next
/// step record; in the summary; and no held-out task in any trained batch.
fn check_evaluations(out: &Path, steps: &[Value], first_reward: f64) {
    let evals: Vec<Value> = std::fs::read_to_string(out.join("eval.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let at: Vec<u64> = evals.iter().map(|e| e["step"].as_u64().unwrap()).collect();
    assert_eq!(at, [0, 20, 40], "{evals:?}");
    for e in &evals {
        assert_eq!(
            (e["eval_tasks"].as_u64(), e["eval_k"].as_u64()),
            (Some(16), Some(4))
        );
        assert_eq!(e["eval_episodes"], 64);
        assert_eq!(e["eval_failed"], 0, "{e}");
        let (k, one) = (
            e["eval_pass_at_k"].as_f64().unwrap(),
            e["eval_pass_at_1"].as_f64().unwrap(),
        );
        assert!(k >= one, "pass@4 is never below pass@1: {e}");
    }
    let reward = |e: &Value| e["eval_reward_mean"].as_f64().unwrap();
    let (start, end) = (reward(&evals[0]), reward(&evals[2]));
    eprintln!("eval reward: step 0 {start:.3}, step 40 {end:.3} (training's first steps {first_reward:.3})");
    assert!(
        (start - first_reward).abs() <= 0.25,
        "the step-0 evaluation scores the base policy: {start:.3} vs {first_reward:.3}"
    );
    assert!(
        end >= start + 0.3,
        "the evaluation rose: {start:.3} -> {end:.3}"
    );
    // Step 1's record carries the evaluation of step 0, step 21's that of step 20.
    assert_eq!(steps[0]["eval_step"], 0);
    assert_eq!(steps[0]["eval_reward_mean"], evals[0]["eval_reward_mean"]);
    assert_eq!(steps[20]["eval_step"], 20);
    assert!(steps[1].get("eval_step").is_none(), "{}", steps[1]);
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["last_eval"], evals[2]);
    // The held-out tasks never reached the trainer.
    let held_out: std::collections::HashSet<String> =
        std::fs::read_to_string(repo().join("examples/successor/eval.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap().to_string())
            .collect();
    for step in 1..=40 {
        let path = out.join(format!("rollouts/step-{step:06}.json"));
        let dump: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        for g in dump["groups"].as_array().unwrap() {
            assert!(
                !held_out.contains(&g["task"].to_string()),
                "step {step} trained on {}",
                g["task"]
            );
        }
    }
}

/// Every step says how busy engines and trainer were: fractions in [0, 1], paused seconds
/// within the step.
fn assert_busy_fractions(r: &Value) {
    let field = |name: &str| {
        r[name]
            .as_f64()
            .unwrap_or_else(|| panic!("{name} missing: {r}"))
    };
    for name in ["engine_busy_fraction", "trainer_busy_fraction"] {
        assert!((0.0..=1.0).contains(&field(name)), "{name}: {r}");
    }
    let paused = field("engine_paused_seconds");
    assert!(
        paused >= 0.0 && paused <= field("step_seconds") + 0.5,
        "{r}"
    );
    assert!(
        field("trainer_busy_fraction") > 0.0,
        "the trainer computed: {r}"
    );
}

/// In a synchronous run engines and trainer take turns: the engines generated during every step,
/// and were idle while the trainer computed, so the two busy fractions never add up to more
/// than the step (a coarse check of both, independent of how each is measured). The run's
/// TensorBoard events hold the same numbers as its metrics.jsonl.
#[test]
fn libtorch_run_sync_engines_are_idle_while_the_trainer_trains() {
    let manifest = recipe();
    let out = out_dir("sync-busy");
    let status = common::moult()
        .arg("run")
        .arg(&manifest)
        .args(["--out".as_ref(), out.as_os_str()])
        .args(["--steps", "4", "--seed", "1", "--sync", "--quiet"])
        .status()
        .unwrap();
    assert!(status.success());
    let steps = metrics(&out);
    assert_eq!(steps.len(), 4);
    for r in &steps {
        assert_busy_fractions(r);
        let engines = r["engine_busy_fraction"].as_f64().unwrap();
        let trainer = r["trainer_busy_fraction"].as_f64().unwrap();
        assert!(engines > 0.0, "the engines generated the step's batch: {r}");
        assert!(
            engines + trainer <= 1.05,
            "engines and trainer overlapped in a synchronous run: {r}"
        );
    }
    // TensorBoard's own reader finds every number of metrics.jsonl under its name, per step.
    let read = Command::new(common::python())
        .arg(repo().join("tests/python/read_tensorboard.py"))
        .arg(out.join("tensorboard"))
        .output()
        .unwrap();
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let scalars: serde_json::Map<String, Value> = serde_json::from_slice(&read.stdout).unwrap();
    // Evaluations (eval.jsonl) are at the step whose policy they measured; a step record's copy
    // of the newest one is not logged again.
    let evals: Vec<Value> = std::fs::read_to_string(out.join("eval.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(evals.len(), 2, "before step 1 and after step 4: {evals:?}");
    for r in steps.iter().chain(&evals) {
        let step = r["step"].as_u64().unwrap();
        let is_eval = r.get("eval_episodes").is_some();
        for (field, value) in r.as_object().unwrap() {
            let Some(x) = value.as_f64() else { continue };
            if field == "step" || field == "policy_version" && is_eval {
                continue;
            }
            if field.starts_with("eval_") != is_eval {
                assert!(!is_eval, "{field} in eval.jsonl");
                continue;
            }
            let points = scalars[field]
                .as_array()
                .unwrap_or_else(|| panic!("{field}"));
            let point = points
                .iter()
                .find(|p| p[0].as_u64() == Some(step))
                .unwrap_or_else(|| panic!("{field} has no step {step}: {points:?}"));
            let got = point[1].as_f64().unwrap();
            assert!(
                (got - x).abs() <= 1e-6 * x.abs().max(1.0),
                "{field} at step {step}: {got} in TensorBoard, {x} in metrics.jsonl"
            );
        }
    }
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    for name in ["engine_busy_fraction", "trainer_busy_fraction"] {
        let f = summary[name].as_f64().unwrap();
        assert!(f > 0.0 && f <= 1.0, "{name}: {summary}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// A run that dumps its batches, and a replay of the dump: the same data, the same initial
/// weights and algorithm, so every step's rewards, advantages and loss come out the same.
#[test]
fn libtorch_run_dumped_batches_replay_to_the_same_steps() {
    let manifest = recipe();
    let out = out_dir("dump");
    let status = common::moult()
        .arg("run")
        .arg(&manifest)
        .args(["--out".as_ref(), out.as_os_str()])
        .args(["--steps", "3", "--seed", "2", "--quiet", "--dump-rollouts"])
        .status()
        .unwrap();
    assert!(status.success());
    let dumps = out.join("rollouts");
    for step in 1..=3 {
        let path = dumps.join(format!("step-{step:06}.json"));
        let dump: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(dump["step"], step);
        let groups = dump["groups"].as_array().unwrap();
        assert_eq!(groups.len(), 8, "the recipe's batch size");
        for e in groups
            .iter()
            .flat_map(|g| g["episodes"].as_array().unwrap())
        {
            assert!(e["reward"].is_number());
            for seg in e["segments"].as_array().unwrap() {
                let len = seg["token_ids"].as_array().unwrap().len();
                for field in ["loss_mask", "logprobs", "versions"] {
                    assert_eq!(seg[field].as_array().unwrap().len(), len, "{field}");
                }
            }
        }
    }
    let replayed = out_dir("replay");
    let status = common::moult()
        .arg("run")
        .arg(&manifest)
        .args(["--out".as_ref(), replayed.as_os_str()])
        .args(["--replay".as_ref(), dumps.as_os_str()])
        .args(["--quiet"])
        .status()
        .unwrap();
    assert!(status.success());
    let (a, b) = (metrics(&out), metrics(&replayed));
    assert_eq!(b.len(), 3, "the dump's 3 steps, not the manifest's 60");
    for (x, y) in a.iter().zip(&b) {
        for field in [
            "reward_mean",
            "advantage_mean",
            "advantage_std",
            "sampled_tokens",
        ] {
            assert_eq!(x[field], y[field], "step {}: {field}", x["step"]);
        }
        let (lx, ly) = (x["loss"].as_f64().unwrap(), y["loss"].as_f64().unwrap());
        assert!(
            (lx - ly).abs() <= 1e-5 * lx.abs().max(1e-3),
            "step {}: loss {lx} vs {ly}",
            x["step"]
        );
        assert_eq!(y["sync_seconds"], 0.0, "a replay publishes nothing");
    }
}

#[test]
fn libtorch_run_resumes_after_sigkill_without_training_a_step_twice() {
    let manifest = recipe();
    let out = out_dir("resume");
    let total = 8u64;
    let start = || {
        common::moult()
            .arg("run")
            .arg(&manifest)
            .args(["--out".as_ref(), out.as_os_str()])
            .args([
                "--steps",
                &total.to_string(),
                "--checkpoint-every",
                "2",
                "--quiet",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut child = start();
    // Kill it once step 3 is logged: step 2's checkpoint is complete, step 3's work is lost.
    let deadline = Instant::now() + Duration::from_secs(300);
    while metrics(&out).len() < 3 {
        assert!(Instant::now() < deadline, "the run made no progress");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let before = metrics(&out).len() as u64;
    assert!(before >= 3);

    let status = start().wait().unwrap();
    assert!(status.success());
    let steps = metrics(&out);
    let numbers: Vec<u64> = steps.iter().map(|r| r["step"].as_u64().unwrap()).collect();
    assert_eq!(numbers, (1..=total).collect::<Vec<_>>(), "each step once");
    let versions: Vec<u64> = steps
        .iter()
        .map(|r| r["policy_version"].as_u64().unwrap())
        .collect();
    assert!(versions.windows(2).all(|w| w[0] < w[1]), "{versions:?}");
    let summary: Value =
        serde_json::from_slice(&std::fs::read(out.join("summary.json")).unwrap()).unwrap();
    let resumed = summary["resumed_from"].as_u64().expect("it resumed");
    assert!(
        resumed >= 2 && resumed < before + 1,
        "resumed from {resumed}"
    );
    assert_eq!(summary["policy_version"], total);
    let latest: Value =
        serde_json::from_slice(&std::fs::read(out.join("checkpoints/latest.json")).unwrap())
            .unwrap();
    assert_eq!(latest["step"], total);
    // The checkpoint is a model folder the engine serves as it is.
    let ckpt = out
        .join("checkpoints")
        .join(latest["path"].as_str().unwrap());
    assert!(ckpt.join("config.json").is_file() && ckpt.join("tokenizer.json").is_file());
    let _ = std::fs::remove_dir_all(&out);
}

/// The recipe's manifest with `edit` applied, written (as JSON, which is YAML) into `dir`, with
/// the paths it names made absolute so it runs from there.
fn edited_recipe(dir: &Path, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let recipe = recipe();
    let here = recipe.parent().unwrap().canonicalize().unwrap();
    let mut run: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(&recipe).unwrap()).unwrap();
    let spec = &mut run["spec"];
    spec["model"]["path"] = here.join("model").to_string_lossy().into();
    spec["agent"]["command"][1] = here.join("env.py").to_string_lossy().into();
    spec["agent"]["dataset"]["path"] = here.join("tasks.jsonl").to_string_lossy().into();
    spec["eval"]["dataset"]["path"] = here.join("eval.jsonl").to_string_lossy().into();
    edit(&mut run);
    std::fs::create_dir_all(dir).unwrap();
    let path = dir.join("rlrun.yaml");
    std::fs::write(&path, serde_json::to_string_pretty(&run).unwrap()).unwrap();
    path
}

/// A Parquet copy of the recipe's tasks, written by Hugging Face `datasets` in two shards and
/// named by a pattern, trains on the same tasks in the same order as the JSONL file (same seed).
#[test]
fn libtorch_run_parquet_tasks_train_as_the_jsonl_file_does() {
    let root = out_dir("parquet");
    let data = root.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let tasks = repo().join("examples/successor/tasks.jsonl");
    let script = "import datasets, sys\n\
        ds = datasets.Dataset.from_json(sys.argv[1])\n\
        for i in range(2):\n\
        \x20   ds.shard(2, i, contiguous=True).to_parquet(f'{sys.argv[2]}/train-{i:05d}-of-00002.parquet')\n";
    let made = Command::new(common::python())
        .args(["-c", script])
        .arg(&tasks)
        .arg(&data)
        .env("HF_HOME", root.join("hf"))
        .output()
        .unwrap();
    assert!(
        made.status.success(),
        "{}",
        String::from_utf8_lossy(&made.stderr)
    );
    let mut trained = Vec::new();
    for (name, path) in [
        ("jsonl", tasks.clone()),
        ("parquet", data.join("train-*.parquet")),
    ] {
        let manifest = edited_recipe(&root.join(name), |run| {
            run["spec"]["agent"]["dataset"]["path"] = path.to_string_lossy().into();
            run["spec"].as_object_mut().unwrap().remove("eval");
        });
        let out = root.join(name).join("out");
        let status = common::moult()
            .arg("run")
            .arg(&manifest)
            .args(["--out".as_ref(), out.as_os_str()])
            .args([
                "--steps",
                "2",
                "--seed",
                "5",
                "--sync",
                "--quiet",
                "--dump-rollouts",
            ])
            .status()
            .unwrap();
        assert!(status.success(), "{name}");
        // Each step's tasks, by their place in the run's order (a synchronous run trains the
        // first batch of the order, then the next).
        let steps: Vec<Vec<(u64, String)>> = (1..=2)
            .map(|step| {
                let path = out.join(format!("rollouts/step-{step:06}.json"));
                let dump: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
                let mut groups: Vec<(u64, String)> = dump["groups"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|g| (g["task_index"].as_u64().unwrap(), g["task"].to_string()))
                    .collect();
                groups.sort();
                groups
            })
            .collect();
        trained.push(steps);
    }
    assert_eq!(trained[0].len(), 2);
    assert_eq!(trained[0][0].len(), 8);
    assert_eq!(
        trained[0], trained[1],
        "JSONL and Parquet runs trained on different tasks"
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// `moult eval` scores a policy on the manifest's held-out tasks alone: the recipe's base model
/// (near chance), with the result as JSON on stdout and in `--out`; a folder that is no model is
/// refused by name.
#[test]
fn libtorch_eval_scores_a_policy_on_the_held_out_tasks() {
    let manifest = recipe();
    let out = out_dir("eval");
    std::fs::create_dir_all(&out).unwrap();
    let file = out.join("eval.json");
    let run = common::moult()
        .arg("eval")
        .arg(&manifest)
        .args(["--out".as_ref(), file.as_os_str()])
        .arg("--quiet")
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let printed: Value = serde_json::from_slice(&run.stdout).unwrap();
    let written: Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(printed, written);
    assert_eq!(
        (
            &printed["step"],
            &printed["eval_tasks"],
            &printed["eval_k"],
            &printed["eval_failed"]
        ),
        (
            &serde_json::json!(0),
            &serde_json::json!(16),
            &serde_json::json!(4),
            &serde_json::json!(0)
        ),
        "{printed}"
    );
    let reward = printed["eval_reward_mean"].as_f64().unwrap();
    assert!(reward <= 0.4, "the base policy is near chance: {printed}");
    let refused = common::moult()
        .arg("eval")
        .arg(&manifest)
        .args(["--checkpoint".as_ref(), out.as_os_str()])
        .arg("--quiet")
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("neither a model folder"), "{err}");
    let _ = std::fs::remove_dir_all(&out);
}

/// `moult ROLE ARGS` with the run's token, its output kept in `log`; with `banner`, the URL that
/// follows it in the role's output (`{banner}http://ADDR ...`), read as it comes.
fn spawn_role(
    args: &[&std::ffi::OsStr],
    env: &[(&str, &Path)],
    log: PathBuf,
    banner: Option<&'static str>,
) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader, Write};
    let mut child = common::moult()
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, v.as_os_str())))
        .env("MOULT_TOKEN", ROLES_TOKEN)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().unwrap());
    let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().unwrap());
    for (stream, log) in [(out, log.with_extension("out")), (err, log)] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let mut file = std::fs::File::create(log).unwrap();
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                let at = banner.and_then(|b| line.split_once(&format!("{b}http://")));
                if let Some((_, url)) = at {
                    let addr = url.split([' ', ',']).next().unwrap_or_default();
                    let _ = tx.send(format!("http://{addr}"));
                }
                let _ = writeln!(file, "{line}");
            }
        });
    }
    let url = match banner {
        Some(_) => rx
            .recv_timeout(Duration::from_secs(120))
            .unwrap_or_default(),
        None => String::new(),
    };
    (child, url)
}

const ROLES_TOKEN: &str = "forged-episodes-test-token";

fn arg(s: &str) -> std::ffi::OsString {
    std::ffi::OsString::from(s)
}

/// The recipe's model.
fn model() -> PathBuf {
    recipe().parent().unwrap().join("model")
}

/// `moult engine` on the recipe's model, logging to `<root>/engine.log`; its URL.
fn spawn_engine(root: &Path) -> (std::process::Child, String) {
    let model = model();
    let args = [
        arg("engine"),
        arg("--model"),
        model.into(),
        arg("--port"),
        arg("0"),
    ];
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    spawn_role(&args, &[], root.join("engine.log"), Some("listening on "))
}

/// `moult coordinator` of `manifest` in front of the engine at `engine`; its URL.
fn spawn_coordinator(root: &Path, manifest: &Path, engine: &str) -> (std::process::Child, String) {
    let args = [
        arg("coordinator"),
        arg("--config"),
        manifest.into(),
        arg("--host"),
        arg("127.0.0.1"),
        arg("--port"),
        arg("0"),
        arg("--lease-time"),
        arg("10s"),
    ];
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let engines = [("MOULT_ENGINES", Path::new(engine))];
    let (child, url) = spawn_role(
        &args,
        &engines,
        root.join("coordinator.log"),
        Some(" tasks) on "),
    );
    assert!(
        url.starts_with("http://127.0.0.1:"),
        "the coordinator's URL: {url:?}"
    );
    (child, url)
}

/// `moult trainer` or `moult agents` of `manifest` for the coordinator at `url` (the trainer with
/// its checkpoints under `<root>/checkpoints`), logging to `<root>/<log>`; a role has
/// `MOULT_STOP_SECONDS=60` to stop on its own.
fn spawn_worker(
    role: &str,
    root: &Path,
    manifest: &Path,
    url: &str,
    log: &str,
) -> std::process::Child {
    let mut args = vec![arg(role), arg("--config"), manifest.into()];
    if role == "agents" {
        args.extend([arg("--coordinator"), arg(url)]);
    }
    args.extend([arg("--metrics-addr"), arg("127.0.0.1:0")]);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    let (model, checkpoints) = (model(), root.join("checkpoints"));
    let env = [
        ("MOULT_MODEL", model.as_path()),
        ("MOULT_COORDINATOR", Path::new(url)),
        ("MOULT_CHECKPOINTS", &checkpoints),
        ("MOULT_STOP_SECONDS", Path::new("60")),
    ];
    spawn_role(&args, &env, root.join(log), None).0
}

/// A forged episode of a lease: one segment of `prompt` tokens (0 loss mask) then two sampled
/// ones, with `image` as the segment's image when given.
fn forged(lease: &Value, prompt: Vec<i64>, image: Option<Value>) -> Value {
    let n = prompt.len();
    let mask = [vec![0; n], vec![1, 1]].concat();
    let logprobs = [vec![0.0; n], vec![-0.5, -0.5]].concat();
    let versions = [vec![None; n], vec![Some(0), Some(0)]].concat();
    let ids: Vec<i64> = prompt.into_iter().chain([40, 41]).collect();
    let mut segment = serde_json::json!({
        "token_ids": ids, "loss_mask": mask, "logprobs": logprobs, "versions": versions,
        "routed_experts": [], "turns": 1,
    });
    if let Some(image) = image {
        segment["images"] = serde_json::json!([image]);
    }
    let index = lease["index"].as_u64().unwrap();
    serde_json::json!({
        "index": index, "session": format!("forged-{index}"), "task": lease["task"],
        "status": "completed", "reward": (index % 2) as f64, "info": {}, "seconds": 0.1,
        "segments": [segment],
    })
}

/// The cluster roles as processes of this machine (`moult engine`, `moult coordinator`, `moult
/// trainer`, `moult agents`, with the run's token, as in the operator's pods) and an agent pod
/// that forges episodes with its agent credential before the trainer starts: whole groups with a
/// 600-token segment (the policy takes 512 positions), with a token outside the vocabulary, and
/// with an image for a policy that has no vision tower (valid to the validator, refused by the
/// trainer). The first two are dropped when their batch is drawn, the third batch is
/// quarantined; the trainer never stops, and the run reaches its last step.
#[test]
fn libtorch_forged_episodes_before_the_trainer_starts_never_stop_it() {
    let root = out_dir("forged");
    let manifest = edited_recipe(&root, |run| {
        run["spec"]["totalSteps"] = 4.into();
        run["spec"].as_object_mut().unwrap().remove("eval");
        // As many generations as the agent pod has sessions (64), the most an honest one needs.
        run["spec"]["coordinator"] = serde_json::json!({"agentLimits": {"generations": 64}});
    });
    let (mut engine, engine_url) = spawn_engine(&root);
    let (mut coordinator, url) = spawn_coordinator(&root, &manifest, &engine_url);
    let agent = moult_operator::credentials::agent_credential(ROLES_TOKEN);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let http = reqwest::Client::new();
    // A call's status and JSON answer (null when there is none).
    let call = |req: reqwest::RequestBuilder| {
        rt.block_on(async {
            let r = req.send().await.unwrap();
            (r.status(), r.json::<Value>().await.unwrap_or(Value::Null))
        })
    };
    let post = |path: &str, body: &Value| {
        call(
            http.post(format!("{url}{path}"))
                .bearer_auth(&agent)
                .json(body),
        )
    };
    // Lease until three groups (episodes 8g..8g+8) are wholly ours; the rest expire to the
    // honest agents.
    let mut groups: std::collections::BTreeMap<u64, Vec<Value>> = Default::default();
    for _ in 0..128 {
        if groups.values().filter(|g| g.len() == 8).count() == 3 {
            break;
        }
        let (status, lease) = post("/v1/agents/lease", &serde_json::json!({}));
        assert!(status.is_success(), "{status}");
        if lease.is_null() {
            continue; // none yet (204)
        }
        groups
            .entry(lease["index"].as_u64().unwrap() / 8)
            .or_default()
            .push(lease);
    }
    let whole: Vec<Vec<Value>> = groups.into_values().filter(|g| g.len() == 8).collect();
    assert_eq!(whole.len(), 3, "three whole groups leased");
    let png = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==";
    let image = serde_json::json!({"offset": 0, "tokens": 1, "data_url": png, "sha256": "00"});
    for (g, leases) in whole.iter().enumerate() {
        for (k, lease) in leases.iter().enumerate() {
            let episode = match (g, k) {
                (0, 0) => forged(lease, vec![5; 600], None),
                (1, 0) => forged(lease, vec![5, 2003 + 50, 6], None),
                (2, _) => forged(lease, vec![5, 6, 7], Some(image.clone())),
                _ => forged(lease, vec![5, 6, 7], None),
            };
            let path = format!("/v1/agents/episodes/{}", lease["lease"].as_str().unwrap());
            let (_, answer) = post(&path, &episode);
            assert_eq!(answer["accepted"], true, "{answer}");
        }
    }
    // The agent credential may hold 64 generations at once: with the engine paused (so none
    // finishes), 64 are taken, the 65th is answered 429, and the count says so.
    let control = |path: &str| call(http.post(format!("{url}{path}")).bearer_auth(ROLES_TOKEN));
    assert!(control("/pause?mode=keep").0.is_success());
    let generate = || {
        let body =
            serde_json::json!({"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}});
        let request = (http.post(format!("{url}/inference/v1/generate")))
            .bearer_auth(&agent)
            .json(&body);
        rt.spawn(async move { request.send().await.unwrap().status() })
    };
    let held: Vec<_> = (0..64).map(|_| generate()).collect();
    // Once the router has them all (each passed the gate), one more is refused.
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, engines) = call(http.get(format!("{url}/engines")).bearer_auth(ROLES_TOKEN));
        if engines["engines"][0]["requests"] == 64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "64 generations never reached the router: {engines}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // (Were it let through, it would wait for the paused engine: the timeout fails the test.)
    let (status, refusal) = call(
        (http.post(format!("{url}/inference/v1/generate")))
            .timeout(Duration::from_secs(30))
            .bearer_auth(&agent)
            .json(&serde_json::json!({"token_ids": [5], "sampling_params": {"max_tokens": 1}})),
    );
    assert_eq!(status, 429, "{refusal}");
    let message = refusal["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        message.contains("spec.coordinator.agentLimits.generations"),
        "{refusal}"
    );
    assert!(control("/resume").0.is_success());
    for generation in held {
        assert_eq!(rt.block_on(generation).unwrap(), 200);
    }
    let mut trainer = spawn_worker("trainer", &root, &manifest, &url, "trainer.log");
    let mut agents = spawn_worker("agents", &root, &manifest, &url, "agents.log");
    let out = root.join("checkpoints/successor");
    let deadline = Instant::now() + Duration::from_secs(600);
    while metrics(&out).len() < 4 {
        let log = std::fs::read_to_string(root.join("trainer.log")).unwrap_or_default();
        assert!(
            trainer.try_wait().unwrap().is_none(),
            "the trainer stopped:\n{log}"
        );
        assert!(Instant::now() < deadline, "no progress:\n{log}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let (_, status) = call(
        http.get(format!("{url}/v1/status"))
            .bearer_auth(ROLES_TOKEN),
    );
    for child in [&mut agents, &mut trainer, &mut coordinator, &mut engine] {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert_eq!(status["trainer_restarts"], 0, "{status}");
    assert_eq!(
        status["agents_refused"],
        serde_json::json!([0, 1, 0]),
        "{status}"
    );
    let rollout = &status["rollout"];
    assert!(
        rollout["dropped_invalid"].as_u64().unwrap() >= 2,
        "{status}"
    );
    assert_eq!(rollout["batches_quarantined"], 1, "{status}");
    let last = metrics(&out).pop().unwrap();
    assert_eq!(last["batches_quarantined"], 1, "{last}");
    let quarantined: Vec<_> = std::fs::read_dir(out.join("quarantine")).unwrap().collect();
    assert_eq!(quarantined.len(), 1);
    let file = std::fs::read_to_string(quarantined[0].as_ref().unwrap().path()).unwrap();
    assert!(
        file.contains("not a vision-language model"),
        "{}",
        &file[..file.len().min(400)]
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// Sends SIGTERM to `child` and waits for it to exit on its own (before its 60 s of grace end:
/// a forced exit is status 143); the seconds it took.
fn stop(child: &mut std::process::Child, what: &str, log: &Path) -> f64 {
    use nix::sys::signal::{kill, Signal};
    let started = Instant::now();
    kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        Signal::SIGTERM,
    )
    .unwrap();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let log = std::fs::read_to_string(log).unwrap_or_default();
            assert!(
                status.success(),
                "{what} exited with {status} on SIGTERM:\n{log}"
            );
            let seconds = started.elapsed().as_secs_f64();
            eprintln!("{what}: exited {seconds:.1} s after SIGTERM");
            return seconds;
        }
        let log = std::fs::read_to_string(log).unwrap_or_default();
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{what} still runs 60 s after SIGTERM:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The cluster roles as processes. SIGTERM reaches the trainer as it finishes a step (as a
/// suspend, a preemption or a node drain sends it): it checkpoints the last step it trained and
/// exits within its grace, though no interval checkpoint was due; started again, it resumes at
/// the step after that one, and the run trains every step once. Then each role exits on SIGTERM
/// whatever it waits for: the engine, the coordinator, agents leasing from a coordinator that is
/// gone, and a trainer waiting for one.
#[test]
fn libtorch_roles_stop_on_sigterm_and_the_trainer_resumes_at_the_next_step() {
    let root = out_dir("sigterm");
    let total = 6;
    let manifest = edited_recipe(&root, |run| {
        run["spec"]["totalSteps"] = total.into();
        run["spec"].as_object_mut().unwrap().remove("eval");
        run["spec"]["checkpoint"] = serde_json::json!({"claimName": "c", "intervalSteps": 100});
    });
    let (mut engine, engine_url) = spawn_engine(&root);
    let (mut coordinator, url) = spawn_coordinator(&root, &manifest, &engine_url);
    let mut trainer = spawn_worker("trainer", &root, &manifest, &url, "trainer.log");
    let mut agents = spawn_worker("agents", &root, &manifest, &url, "agents.log");
    let out = root.join("checkpoints/successor");
    let wait_for_steps = |trainer: &mut std::process::Child, log: &str, steps: usize| {
        let deadline = Instant::now() + Duration::from_secs(600);
        while metrics(&out).len() < steps {
            let log = std::fs::read_to_string(root.join(log)).unwrap_or_default();
            assert!(
                trainer.try_wait().unwrap().is_none(),
                "the trainer stopped:\n{log}"
            );
            assert!(Instant::now() < deadline, "no progress:\n{log}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    wait_for_steps(&mut trainer, "trainer.log", 2);
    stop(&mut trainer, "the trainer", &root.join("trainer.log"));
    let trained = metrics(&out).len() as u64;
    let latest: Value =
        serde_json::from_slice(&std::fs::read(out.join("checkpoints/latest.json")).unwrap())
            .unwrap();
    assert_eq!(
        latest["step"], trained,
        "the checkpoint is of the last step trained"
    );

    let mut trainer = spawn_worker("trainer", &root, &manifest, &url, "trainer-2.log");
    wait_for_steps(&mut trainer, "trainer-2.log", total as usize);
    let log = std::fs::read_to_string(root.join("trainer-2.log")).unwrap();
    assert!(
        log.contains(&format!("from step {trained} of {total}")),
        "{log}"
    );
    let steps: Vec<u64> = metrics(&out)
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=total).collect::<Vec<_>>(), "each step once");
    let status: Value = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let status = reqwest::Client::new()
            .get(format!("{url}/v1/status"))
            .bearer_auth(ROLES_TOKEN);
        status.send().await.unwrap().json().await.unwrap()
    });
    assert_eq!(status["trainer_restarts"], 1, "{status}");

    // Each role exits on SIGTERM, whatever it waits for.
    stop(
        &mut trainer,
        "a finished trainer",
        &root.join("trainer-2.log"),
    );
    stop(&mut engine, "the engine", &root.join("engine.log"));
    stop(
        &mut coordinator,
        "the coordinator",
        &root.join("coordinator.log"),
    );
    let mut waiting = spawn_worker("trainer", &root, &manifest, &url, "trainer-3.log");
    let deadline = Instant::now() + Duration::from_secs(120);
    while !std::fs::read_to_string(root.join("trainer-3.log"))
        .unwrap_or_default()
        .contains("waiting for engines")
    {
        assert!(
            Instant::now() < deadline,
            "the trainer never waited for the coordinator"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    stop(
        &mut waiting,
        "a trainer waiting for a coordinator that is gone",
        &root.join("trainer-3.log"),
    );
    stop(
        &mut agents,
        "agents leasing from a coordinator that is gone",
        &root.join("agents.log"),
    );
    let _ = std::fs::remove_dir_all(&root);
}
