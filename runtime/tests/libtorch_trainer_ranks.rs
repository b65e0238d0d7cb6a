//! A trainer of several ranks (separate processes joined by libtorch's c10d Gloo group, as
//! `moult trainer` starts them) computes the step one rank would: after three steps on tiny dense
//! (tied embeddings) and MoE (untied, sparse layers with unrouted experts) models, the weights,
//! the AdamW moments and every step's gradient norm and loss equal the single-rank trainer's
//! within 1e-5, for 2, 3 (uneven shards) and 4 ranks (docs/distributed.md).
//!
//! Each rank is this test binary run again with the `MOULT_TRAINER_*` environment of a rank;
//! rank 0 writes what it ended with for the parent to compare.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use moult_runtime::algorithms::losses::Aggregation;
use moult_runtime::dist::{Collectives, Rendezvous, ENV_MASTER, ENV_RANK, ENV_TIMEOUT, ENV_WORLD};
use moult_runtime::learner::checkpoint::{self, CheckpointMeta};
use moult_runtime::model::CausalLm;
use moult_runtime::trainer::optim::{Decay, LrSchedule};
use moult_runtime::trainer::ranks::{follower, leader, Setup};
use moult_runtime::trainer::step::{LossConfig, LossKind};
use moult_runtime::trainer::train::{Sample, Sharding, Trainer, TrainerOptions};
use tch::{Device, Kind, Tensor};

const STEPS: usize = 3;
/// Where a rank process writes its result (set by the parent for rank processes only).
const ENV_OUT: &str = "MOULT_TEST_RANK_OUT";
const ENV_MODEL: &str = "MOULT_TEST_RANK_MODEL";
/// Set for the checkpoint test: `save:<root>` trains two steps and writes a checkpoint under
/// `<root>` (through the run's own checkpoint code); `resume:<root>` continues from its newest
/// checkpoint for one step.
const ENV_PHASE: &str = "MOULT_TEST_RANK_PHASE";
/// Set for the killed-rank test: rank 0 trains until the group breaks, and writes this file
/// after its second step.
const ENV_MARKER: &str = "MOULT_TEST_RANK_MARKER";

/// The sharding the rank processes use (`optimizer` or `full`).
const ENV_SHARDING: &str = "MOULT_TEST_RANK_SHARDING";

fn options() -> TrainerOptions {
    options_for(&std::env::var(ENV_SHARDING).unwrap_or_default())
}

/// The options of `given` sharding: `optimizer`, `full`, `full-bf16`, or `lora` (a LoRA adapter
/// of rank 4 on every projection, with `sharding: Full` asked for: the trainer shards the
/// optimizer state only).
fn options_for(given: &str) -> TrainerOptions {
    let sharding = match given {
        "optimizer" => Sharding::Optimizer,
        _ => Sharding::Full,
    };
    TrainerOptions {
        loss: LossConfig {
            kind: LossKind::PpoClip,
            eps_low: 0.2,
            eps_high: 0.28,
            aggregation: Aggregation::TokenMean,
            correction: None,
            temperature: 1.0,
        },
        schedule: LrSchedule {
            peak: 3e-3,
            warmup_steps: 0,
            total_steps: 10,
            decay: Decay::Constant,
            min_ratio: 1.0,
        },
        weight_decay: 0.01,
        // Small enough that every step clips.
        max_grad_norm: Some(0.5),
        // Several micro-batches per rank.
        micro_batch_tokens: 40,
        kl_coef: 0.0,
        sharding,
        // `full-bf16`: sharded weights gathered as bfloat16.
        bf16_compute: given == "full-bf16",
        freeze_vision: false,
        lora: (given == "lora").then(|| moult_runtime::model::lora::LoraConfig {
            rank: 4,
            alpha: 8.0,
            rslora: false,
            dropout: 0.0,
            targets: moult_runtime::model::lora::TARGETS.map(String::from).into(),
        }),
    }
}

/// Step `step`'s batch: 7 sequences of 9 to 27 tokens, prompt unmasked, mixed advantages.
fn batch(step: usize) -> Vec<Sample> {
    (0..7)
        .map(|i| {
            let len = 9 + ((i * 5 + step * 3) % 19);
            let prompt = 4 + i % 3;
            let tokens: Vec<i64> = (0..len)
                .map(|j| ((i * 131 + j * 17 + step * 7) % 2000) as i64)
                .collect();
            Sample {
                loss_mask: (0..len).map(|j| (j >= prompt) as u8).collect(),
                behaviour_logprobs: vec![-3.0; len],
                advantage: [1.0, -0.5, 0.25, -1.0, 0.75, 0.0, -0.25][i],
                token_advantages: None,
                replay: None,
                images: Vec::new(),
                tokens,
            }
        })
        .collect()
}

/// What a trainer ends with: its weights (by checkpoint name), its moments and each step's
/// (loss, grad norm).
struct Trained {
    weights: Vec<(String, Tensor)>,
    moments: Vec<(Tensor, Tensor)>,
    stats: Vec<(f64, f64)>,
}

/// Trains STEPS steps.
fn train(trainer: &mut Trainer) -> Trained {
    train_from(trainer, 0)
}

/// Trains steps `start..STEPS` (a trainer resumed after `start`).
fn train_from(trainer: &mut Trainer, start: usize) -> Trained {
    let stats: Vec<(f64, f64)> = (start..STEPS)
        .map(|s| {
            let st = trainer.step(&batch(s)).unwrap();
            assert!(!st.skipped, "{st:?}");
            (st.loss, st.grad_norm)
        })
        .collect();
    let weights = trainer
        .weights()
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    Trained {
        weights,
        moments: trainer.moments().unwrap(),
        stats,
    }
}

/// In float64: the ranks split the batch (and its micro-batches) differently from one rank, so
/// float32 sums round differently (~1e-5 relative on these gradients, which AdamW then
/// amplifies where gradients nearly cancel); float64 leaves only the logic to compare.
fn load(dir: &Path) -> CausalLm {
    load_on(dir, Device::Cpu)
}

fn load_on(dir: &Path, device: Device) -> CausalLm {
    CausalLm::load(dir, Kind::Double, device).unwrap()
}

/// Set to `cuda` (scripts/gpu-check.sh) to run rank r on GPU r, its collectives over NCCL; the
/// single rank they are compared with stays on the CPU.
const ENV_RANK_DEVICE: &str = "MOULT_TEST_RANK_DEVICE";

/// The device of rank `rank` (the CPU unless `ENV_RANK_DEVICE=cuda`).
fn rank_device(rank: usize) -> Device {
    match std::env::var(ENV_RANK_DEVICE).as_deref() {
        Ok("cuda") => Device::Cuda(rank),
        _ => Device::Cpu,
    }
}

/// The rank a process is, when the parent started it as one.
fn as_rank() -> bool {
    let Some(out) = std::env::var_os(ENV_OUT) else {
        return false;
    };
    let model = PathBuf::from(std::env::var_os(ENV_MODEL).unwrap());
    let rendezvous = Rendezvous::from_env()
        .unwrap()
        .expect("a rank's environment");
    let device = rank_device(rendezvous.rank);
    let group = rendezvous.connect_on(device).unwrap();
    if group.rank() > 0 {
        let mut trainer = follower(group, device).unwrap();
        assert_eq!(trainer.world_size(), rendezvous.world);
        let phase = std::env::var(ENV_PHASE).unwrap_or_default();
        let expected = if phase.starts_with("save:") {
            2
        } else if phase.starts_with("publish:") {
            1
        } else {
            STEPS as u64
        };
        assert_eq!(
            trainer.follow().unwrap(),
            expected,
            "steps this rank took part in"
        );
        return true;
    }
    let setup = Setup {
        model_dir: model.clone(),
        reference_dir: None,
        dtype: "float64".into(),
        options: options(),
    };
    let phase = std::env::var(ENV_PHASE).ok();
    if let Some(transport) = phase.as_deref().and_then(|p| p.strip_prefix("publish:")) {
        publish_from_ranks(&model, setup, group, transport);
        return true;
    }
    if let Some(root) = phase.as_deref().and_then(|p| p.strip_prefix("save:")) {
        let mut trainer = leader(load_on(&model, device), None, setup, None, group).unwrap();
        for step in 0..2 {
            trainer.step(&batch(step)).unwrap();
        }
        let meta = CheckpointMeta {
            step: 2,
            policy_version: 2,
            rollout: Default::default(),
            seed: 1,
        };
        checkpoint::save(Path::new(root), &model, &trainer, &meta).unwrap();
        trainer.stop_followers().unwrap();
        return true;
    }
    let resume = phase
        .as_deref()
        .and_then(|p| p.strip_prefix("resume:"))
        .map(|root| {
            let (dir, meta) = checkpoint::latest(Path::new(root)).unwrap().unwrap();
            let (model, moments) = checkpoint::load_policy(&dir, Kind::Double, device).unwrap();
            (model, meta.step, moments)
        });
    let (start, mut trainer) = match resume {
        Some((weights, steps, moments)) => (
            steps as usize,
            leader(weights, None, setup, Some((steps, moments)), group).unwrap(),
        ),
        None => (
            0,
            leader(load_on(&model, device), None, setup, None, group).unwrap(),
        ),
    };
    assert_eq!(trainer.world_size(), rendezvous.world);
    if let Some(marker) = std::env::var_os(ENV_MARKER) {
        for step in 0.. {
            if let Err(e) = trainer.step(&batch(step % 3)) {
                panic!("rank 0 stopped: {e}");
            }
            if step == 1 {
                std::fs::write(&marker, "trained").unwrap();
            }
        }
    }
    let Trained {
        weights,
        moments,
        stats,
    } = train_from(&mut trainer, start);
    trainer.stop_followers().unwrap();
    {
        let mut named: Vec<(String, Tensor)> = Vec::new();
        for (name, w) in weights {
            named.push((format!("w.{name}"), w.to_device(Device::Cpu)));
        }
        for (i, (m, v)) in moments.into_iter().enumerate() {
            named.push((format!("m.{i}"), m.to_device(Device::Cpu)));
            named.push((format!("v.{i}"), v.to_device(Device::Cpu)));
        }
        let flat: Vec<f64> = stats.iter().flat_map(|&(l, g)| [l, g]).collect();
        named.push(("stats".into(), Tensor::from_slice(&flat)));
        Tensor::write_safetensors(&named, PathBuf::from(out)).unwrap();
    }
    true
}

/// Rank 0 of the publishing test: one step in float32 (what the built-in engine holds), then the
/// weights published to an engine through `transport` while the ranks gather them unit by unit;
/// the engine's logprobs must be those of the trainer's weights.
fn publish_from_ranks(model: &Path, setup: Setup, group: Box<dyn Collectives>, transport: &str) {
    use moult_operator::api::WeightTransport;
    use moult_runtime::engine::sampling::SamplingParams;
    use moult_runtime::weight_sync::publish::{PublishOptions, Publisher};

    let setup = Setup {
        dtype: "float32".into(),
        ..setup
    };
    let base = CausalLm::load(model, Kind::Float, Device::Cpu).unwrap();
    let mut trainer = leader(base, None, setup, None, group).unwrap();
    trainer.step(&batch(0)).unwrap();
    let transport = match transport {
        "tcp" => WeightTransport::Tcp,
        _ => WeightTransport::Filesystem,
    };
    let folder = std::env::temp_dir().join(format!("moult-rank-publish-{}", std::process::id()));
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (mut engine, url) = common::spawn_engine(model);
    let (trainer, generation, report) = runtime.block_on(async {
        let mut publisher = Publisher::connect(&PublishOptions {
            target: url.clone(),
            transport,
            device: Device::Cpu,
            host: "127.0.0.1".into(),
            port: 0,
            folder: Some(folder.clone()),
            engine_kind: Kind::Float,
            pool: None,
        })
        .await
        .unwrap();
        let never = tokio_util::sync::CancellationToken::new();
        let (trainer, gathered, sent) = publisher.publish_trainer(trainer, 1, true, &never).await;
        gathered.unwrap();
        let report = sent.unwrap();
        let body = serde_json::json!({"token_ids": &batch(5)[0].tokens[..6], "stream": true,
            "sampling_params": {"max_tokens": 8, "ignore_eos": true, "seed": 3}});
        let response = reqwest::Client::new()
            .post(format!("{url}/inference/v1/generate"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let generation = common::Generation::read(response, |_| {}).await;
        (trainer, generation, report)
    });
    engine.kill().unwrap();
    engine.wait().unwrap();
    // A bucket per unit: the embedding, each layer and the final norm (at least).
    let layers = trainer.model().config().num_hidden_layers;
    assert!(
        report.buckets >= layers + 2,
        "{} buckets for {layers} layers",
        report.buckets
    );
    if transport == WeightTransport::Filesystem {
        let index = folder.join("v1/model.safetensors.index.json");
        assert!(index.is_file(), "one file per bucket, and their index");
        std::fs::remove_dir_all(&folder).unwrap();
    }
    assert_eq!(generation.versions, vec![1; 8], "served by the new weights");
    let trained = CausalLm::load(model, Kind::Float, Device::Cpu).unwrap();
    tch::no_grad(|| {
        for (name, t) in trainer.weights().unwrap() {
            trained.params()[&name].shallow_clone().copy_(&t);
        }
    });
    trainer.stop_followers().unwrap();
    let params = SamplingParams {
        max_tokens: 8,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let prompt = &batch(5)[0].tokens[..6];
    let want = common::reference_logprobs(&trained, prompt, &generation.ids, &params, None);
    let before = CausalLm::load(model, Kind::Float, Device::Cpu).unwrap();
    let old = common::reference_logprobs(&before, prompt, &generation.ids, &params, None);
    let gap = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    let (new_gap, old_gap) = (
        gap(&generation.logprobs, &want),
        gap(&generation.logprobs, &old),
    );
    println!(
        "{transport:?}: {} buckets, {} bytes; engine vs trainer logprobs {new_gap:.2e}, vs the weights before the step {old_gap:.2e}",
        report.buckets, report.bytes
    );
    assert!(new_gap < 1e-4, "the engine serves other weights: {new_gap}");
    assert!(
        old_gap > 1e-3,
        "the step changed nothing the engine shows: {old_gap}"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `world` rank processes of `test` on `model`; returns rank 0's result file.
fn run_ranks(test: &str, model: &Path, world: usize, sharding: &str) -> PathBuf {
    run_ranks_with(test, model, world, sharding, None)
}

/// [`run_ranks`] in a checkpoint phase (`ENV_PHASE`).
fn run_ranks_with(
    test: &str,
    model: &Path,
    world: usize,
    sharding: &str,
    phase: Option<&str>,
) -> PathBuf {
    // Named by test and phase too: the tests of this binary run at once on the same model.
    let phase_name = phase.map_or("", |p| p.split(':').next().unwrap_or(""));
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "ranks-{test}-{phase_name}-{sharding}-{}-{world}-{}.safetensors",
        model.file_name().unwrap().to_string_lossy(),
        std::process::id()
    ));
    let master = format!("127.0.0.1:{}", free_port());
    let children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", test, "--nocapture", "--test-threads", "1"])
                .env(ENV_OUT, &out)
                .env(ENV_MODEL, model)
                .env(ENV_RANK, rank.to_string())
                .env(ENV_WORLD, world.to_string())
                .env(ENV_MASTER, &master)
                .env(ENV_TIMEOUT, "60")
                .env(ENV_PHASE, phase.unwrap_or(""))
                .env(ENV_SHARDING, sharding)
                // The LM head in chunks of 6 rows (the vocabulary is 2003): several per
                // micro-batch, the last one short.
                .env("MOULT_HEAD_CHUNK_ELEMENTS", "14000")
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, mut child) in children.into_iter().enumerate() {
        assert!(
            child.wait().unwrap().success(),
            "rank {rank} of {world} failed"
        );
    }
    out
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.size(), b.size());
    (a - b).abs().max().double_value(&[])
}

/// Rank 0's result file against one rank's weights and moments: the largest difference, and
/// rank 0's (loss, grad norm) per step, flat.
fn compare(
    file: &Path,
    weights: &[(String, Tensor)],
    moments: &[(Tensor, Tensor)],
) -> (f64, Vec<f64>) {
    let got: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(file)
        .unwrap()
        .into_iter()
        .collect();
    let _ = std::fs::remove_file(file);
    let mut worst: f64 = 0.0;
    assert_eq!(
        got.keys().filter(|k| k.starts_with("w.")).count(),
        weights.len(),
        "the ranks' weights have the names one rank's have"
    );
    for (name, w) in weights {
        worst = worst.max(max_diff(&got[&format!("w.{name}")], w));
    }
    for i in 0..moments.len() {
        worst = worst.max(max_diff(&got[&format!("m.{i}")], &moments[i].0));
        worst = worst.max(max_diff(&got[&format!("v.{i}")], &moments[i].1));
    }
    (worst, Vec::<f64>::try_from(&got["stats"]).unwrap())
}

fn check(test: &str, model: &Path, cases: &[(usize, &str)]) {
    let mut one = Trainer::new(load(model), None, options_for(cases[0].1)).unwrap();
    let Trained {
        weights,
        moments,
        stats,
    } = train(&mut one);
    assert_eq!(moments.len(), one.model().trainable().len());
    if cases[0].1 == "lora" {
        assert!(
            weights.iter().all(|(n, _)| n.contains(".lora_")),
            "adapter only"
        );
    }
    for &(world, sharding) in cases {
        let file = run_ranks(test, model, world, sharding);
        let (worst, theirs) = compare(&file, &weights, &moments);
        for (s, &(loss, norm)) in stats.iter().enumerate() {
            assert!(
                (theirs[2 * s] - loss).abs() < 1e-5 && (theirs[2 * s + 1] - norm).abs() < 1e-5,
                "{world} ranks, step {s}: (loss, grad norm) ({}, {}) vs one rank's ({loss}, {norm})",
                theirs[2 * s],
                theirs[2 * s + 1]
            );
        }
        println!(
            "{} with {world} ranks ({sharding} sharding): largest difference from one rank {worst:.2e} (weights and moments), grad norms {:?}",
            model.file_name().unwrap().to_string_lossy(),
            stats.iter().map(|s| s.1).collect::<Vec<_>>()
        );
        assert!(
            worst < 1e-5,
            "{world} ranks ({sharding}) differ from one rank by {worst:e}"
        );
    }
}

#[test]
fn libtorch_sharded_ranks_train_the_dense_model_as_one_rank_does() {
    if as_rank() {
        return;
    }
    check(
        "libtorch_sharded_ranks_train_the_dense_model_as_one_rank_does",
        &common::dense_model(),
        SHARDED,
    );
}

/// Sharded weights with 2, 3 (uneven shards) and 4 ranks; sharded optimizer state alone with 3.
const SHARDED: &[(usize, &str)] = &[(2, "full"), (3, "full"), (4, "full"), (3, "optimizer")];

/// A LoRA adapter trained on 2 and 3 ranks is the one one rank trains (docs/lora.md): the
/// adapter replicated, its optimizer state sharded; only the adapter's tensors are the weights.
#[test]
fn libtorch_ranks_train_a_lora_adapter_as_one_rank_does() {
    if as_rank() {
        return;
    }
    for model in [common::dense_model(), common::moe_model()] {
        let test = "libtorch_ranks_train_a_lora_adapter_as_one_rank_does";
        check(test, &model, &[(2, "lora"), (3, "lora")]);
    }
}

#[test]
fn libtorch_sharded_ranks_train_the_moe_model_as_one_rank_does() {
    if as_rank() {
        return;
    }
    check(
        "libtorch_sharded_ranks_train_the_moe_model_as_one_rank_does",
        &common::moe_model(),
        SHARDED,
    );
}

/// A rank killed mid-training makes the others fail within a bounded time (the collective sees
/// the closed connection; the heartbeats in the rendezvous store say whose), with an error that
/// names the lost rank: never a hang.
#[test]
fn libtorch_a_killed_rank_fails_the_others_naming_it() {
    if as_rank() {
        return;
    }
    let test = "libtorch_a_killed_rank_fails_the_others_naming_it";
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let marker = tmp.join(format!("killed-rank-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let master = format!("127.0.0.1:{}", free_port());
    let world = 3;
    let logs: Vec<PathBuf> = (0..world)
        .map(|r| tmp.join(format!("killed-rank-{}-{r}.log", std::process::id())))
        .collect();
    let mut children: Vec<_> = (0..world)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", test, "--nocapture", "--test-threads", "1"])
                .env(ENV_OUT, tmp.join("unused"))
                .env(ENV_MODEL, common::dense_model())
                .env(ENV_MARKER, &marker)
                .env(ENV_RANK, rank.to_string())
                .env(ENV_WORLD, world.to_string())
                .env(ENV_MASTER, &master)
                .env(ENV_TIMEOUT, "60")
                .stderr(std::fs::File::create(&logs[rank]).unwrap())
                // Their harness reports the failures this test causes: not the parent's.
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let started = std::time::Instant::now();
    while !marker.exists() {
        assert!(
            started.elapsed().as_secs() < 120,
            "rank 0 never trained two steps"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    children[1].kill().unwrap();
    children[1].wait().unwrap();
    let killed = std::time::Instant::now();
    for rank in [0, 2] {
        let status = loop {
            if let Some(status) = children[rank].try_wait().unwrap() {
                break status;
            }
            if killed.elapsed().as_secs() > 90 {
                let _ = children[rank].kill();
                panic!("rank {rank} still runs 90 s after rank 1 was killed: it hangs");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert!(!status.success(), "rank {rank} went on without rank 1");
    }
    println!(
        "ranks 0 and 2 failed {:.1} s after rank 1 was killed",
        killed.elapsed().as_secs_f64()
    );
    let said = |log: &str| -> String {
        log.lines()
            .filter(|l| l.contains("was lost"))
            .take(1)
            .collect()
    };
    let log0 = std::fs::read_to_string(&logs[0]).unwrap();
    println!("rank 0: {}", said(&log0));
    println!(
        "rank 2: {}",
        said(&std::fs::read_to_string(&logs[2]).unwrap())
    );
    assert!(log0.contains("rank 1 was lost"), "rank 0 says: {log0}");
    let log2 = std::fs::read_to_string(&logs[2]).unwrap();
    assert!(
        log2.contains("rank 1 was lost") || log2.contains("rank 0 was lost"),
        "rank 2 says: {log2}"
    );
    for f in logs.iter().chain([&marker]) {
        let _ = std::fs::remove_file(f);
    }
}

/// Save with 2 ranks and resume with 4, and the reverse: the continued run equals one rank's
/// uninterrupted run. Each rank writes its own shards; `moult export`'s folder has the whole
/// weights, and its logprobs in the engine's forward are the uninterrupted trainer's.
#[test]
fn libtorch_a_checkpoint_of_some_ranks_resumes_on_any_number() {
    if as_rank() {
        return;
    }
    use moult_runtime::model::SeqInput;
    use moult_runtime::trainer::logprobs::token_logprobs;
    let test = "libtorch_a_checkpoint_of_some_ranks_resumes_on_any_number";
    let model = common::dense_model();
    let mut one = Trainer::new(load(&model), None, options()).unwrap();
    let mut after_two = None;
    let mut stats = Vec::new();
    for s in 0..STEPS {
        let st = one.step(&batch(s)).unwrap();
        stats.push((st.loss, st.grad_norm));
        if s == 1 {
            let tokens = &batch(5)[0].tokens;
            let seqs = [SeqInput {
                slot: None,
                tokens,
                replay: None,
                images: &[],
            }];
            after_two = Some(tch::no_grad(|| {
                token_logprobs(one.model(), &seqs, 1.0).unwrap()
            }));
        }
    }
    let weights: Vec<(String, Tensor)> = one
        .weights()
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    let moments = one.moments().unwrap();
    for (saved, resumed) in [(2, 4), (4, 2)] {
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "ranks-ckpt-{saved}-{resumed}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&root);
        let phase = |p: &str| format!("{p}:{}", root.display());
        run_ranks_with(test, &model, saved, "full", Some(&phase("save")));
        // Each rank wrote its shards, no whole model; the export serves: the engine's forward
        // on it scores as the trainer did.
        let (dir, meta) = checkpoint::latest(&root).unwrap().unwrap();
        assert_eq!(meta.step, 2);
        assert!(!dir.join("model.safetensors").exists());
        let shard_files: Vec<u64> = (0..saved)
            .map(|r| {
                let f = dir.join(format!("shards/rank-{r:05}-of-{saved:05}.safetensors"));
                std::fs::metadata(&f).unwrap().len()
            })
            .collect();
        let refused = checkpoint::model_folder(&dir).unwrap_err().to_string();
        assert!(refused.contains("moult export"), "{refused}");
        let exported = root.join("exported");
        assert_eq!(checkpoint::export(&root, &exported).unwrap(), dir);
        assert!(
            checkpoint::export(&root, &exported).is_err(),
            "export overwrote a folder"
        );
        let served = CausalLm::load(&exported, Kind::Double, Device::Cpu).unwrap();
        let tokens = &batch(5)[0].tokens;
        let seqs = [SeqInput {
            slot: None,
            tokens,
            replay: None,
            images: &[],
        }];
        let lp = tch::no_grad(|| token_logprobs(&served, &seqs, 1.0).unwrap());
        let gap = max_diff(&lp, after_two.as_ref().unwrap());
        assert!(gap < 1e-5, "the checkpoint's logprobs differ by {gap}");
        let file = run_ranks_with(test, &model, resumed, "full", Some(&phase("resume")));
        let (worst, theirs) = compare(&file, &weights, &moments);
        let (loss, norm) = stats[STEPS - 1];
        assert!(
            (theirs[0] - loss).abs() < 1e-5 && (theirs[1] - norm).abs() < 1e-5,
            "step 3 after resuming: ({}, {}) vs ({loss}, {norm})",
            theirs[0],
            theirs[1]
        );
        println!(
            "saved by {saved} ranks (shard files of {shard_files:?} bytes), resumed on {resumed}: largest difference from one uninterrupted rank {worst:.2e}; exported logprobs {gap:.2e}"
        );
        assert!(worst < 1e-5, "{saved} -> {resumed} ranks: {worst:e}");
        let _ = std::fs::remove_dir_all(&root);
    }
}

/// A rank that asks for a GPU where there is none (or in a build without NCCL) fails to join with
/// an error that says so, rather than crashing or falling back to the CPU.
#[test]
fn libtorch_a_gpu_rank_without_a_gpu_says_why() {
    if as_rank() || tch::Cuda::is_available() {
        return;
    }
    let rendezvous = Rendezvous {
        host: "127.0.0.1".into(),
        port: free_port(),
        rank: 0,
        world: 1,
        timeout: std::time::Duration::from_secs(10),
    };
    let err = rendezvous
        .connect_on(Device::Cuda(0))
        .unwrap_err()
        .to_string();
    println!("{err}");
    assert!(err.contains("rendezvous"), "{err}");
    assert!(
        err.contains("CUDA") || err.contains("NCCL") || err.contains("GPU"),
        "{err}"
    );
}

/// A sharded trainer of two ranks publishes to a built-in engine bucket by bucket, a unit at a
/// time as the ranks gather it, over the TCP stream and through a folder: the engine then serves
/// the trainer's weights.
#[test]
fn libtorch_sharded_ranks_publish_bucket_by_bucket_over_every_transport() {
    if as_rank() {
        return;
    }
    let test = "libtorch_sharded_ranks_publish_bucket_by_bucket_over_every_transport";
    let model = common::dense_model();
    for transport in ["tcp", "filesystem"] {
        run_ranks_with(
            test,
            &model,
            2,
            "full",
            Some(&format!("publish:{transport}")),
        );
    }
}

/// bfloat16 compute (weights gathered as bfloat16; the shards, the gradients' reduction and
/// AdamW stay in the master dtype, float64 here) follows the full-precision trainer: each step's
/// loss and gradient norm within 5%, and the weights' distance from one rank's within a quarter
/// of how far one rank's moved in the three steps, with the moments still in the master dtype.
#[test]
fn libtorch_bfloat16_compute_follows_full_precision() {
    if as_rank() {
        return;
    }
    let test = "libtorch_bfloat16_compute_follows_full_precision";
    let model = common::dense_model();
    let initial: std::collections::HashMap<String, Tensor> =
        Trainer::new(load(&model), None, options())
            .unwrap()
            .weights()
            .unwrap()
            .into_iter()
            .map(|(n, t)| (n, t.copy()))
            .collect();
    let mut one = Trainer::new(load(&model), None, options()).unwrap();
    let Trained { weights, stats, .. } = train(&mut one);
    let file = run_ranks(test, &model, 2, "full-bf16");
    let got: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&file)
        .unwrap()
        .into_iter()
        .collect();
    let _ = std::fs::remove_file(&file);
    assert_eq!(
        got["m.0"].kind(),
        Kind::Double,
        "moments in the master dtype"
    );
    let theirs = Vec::<f64>::try_from(&got["stats"]).unwrap();
    for (s, &(loss, norm)) in stats.iter().enumerate() {
        let (l, n) = (theirs[2 * s], theirs[2 * s + 1]);
        println!("step {s}: bfloat16 (loss {l:.5}, grad norm {n:.4}), full precision ({loss:.5}, {norm:.4})");
        assert!(
            (l - loss).abs() <= 0.05 * loss.abs().max(0.1) && (n - norm).abs() <= 0.05 * norm,
            "step {s}: bfloat16 ({l}, {n}) vs full precision ({loss}, {norm})"
        );
    }
    let (mut apart, mut moved) = (0.0, 0.0);
    for (name, w) in &weights {
        let b = &got[&format!("w.{name}")];
        assert_eq!(b.kind(), Kind::BFloat16, "{name}: published as gathered");
        apart += (b.to_kind(Kind::Double) - w)
            .square()
            .sum(Kind::Double)
            .double_value(&[]);
        moved += (w - &initial[name])
            .square()
            .sum(Kind::Double)
            .double_value(&[]);
    }
    let ratio = (apart / moved).sqrt();
    println!("bfloat16 weights are {ratio:.3} of full precision's movement away from it");
    assert!(
        ratio < 0.25,
        "bfloat16 compute strays {ratio} of the update"
    );
}
