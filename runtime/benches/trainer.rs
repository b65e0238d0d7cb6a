//! Trainer benchmark, printed as a table of ratios measured in one invocation (this machine is
//! noisy; compare within a run, never against a fixed number): one training step of moult
//! (`policy_loss`, backward, `clip_grad_norm`, AdamW) vs the same step written
//! in PyTorch with transformers' `Qwen3ForCausalLM` (`tests/python/bench_trainer_step.py`), on
//! the same checkpoint, batch, loss and optimizer settings and the same number of intra-op
//! threads. Also printed: where each side's step goes (loss forward, backward, optimizer), and both sides' first losses and gradient norm, which must agree.
//!
//! `cargo bench -p moult-runtime --bench trainer` (after `source scripts/env.sh`); `-- --quick`
//! runs the tiny model only, with fewer steps; `-- --threads N` sets both sides' intra-op threads
//! (default 1: on a shared 2-core machine two threads stall each other whenever a core is taken).
//! Documented in docs/benchmarks.md.

use std::path::Path;
use std::time::Instant;

use moult_runtime::algorithms::correction::{Correction, Level, Mode};
use moult_runtime::algorithms::losses::Aggregation;
use moult_runtime::model::CausalLm;
use moult_runtime::model::SeqInput;
use moult_runtime::trainer::logprobs::token_logprobs;
use moult_runtime::trainer::optim::{clip_grad_norm, AdamW};
use moult_runtime::trainer::step::{policy_loss, LossConfig, LossKind, Sample};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

mod common;
use common::{quantile, qwen3_width_model, root, run_python, tiny_model};

const PROMPT: usize = 32;
const LR: f64 = 1e-5;
const BETAS: (f64, f64) = (0.9, 0.999);
const ADAM_EPS: f64 = 1e-8;
const WEIGHT_DECAY: f64 = 0.01;
const MAX_GRAD_NORM: f64 = 1.0;

/// PPO-clip (DAPO's ε), token-mean, token-level IS mask [0.5, 5] (IcePop), temperature 1.
const LOSS: LossConfig = LossConfig {
    kind: LossKind::PpoClip,
    eps_low: 0.2,
    eps_high: 0.28,
    aggregation: Aggregation::TokenMean,
    correction: Some(Correction {
        level: Level::Token,
        mode: Mode::Mask,
        low: 0.5,
        high: 5.0,
    }),
    temperature: 1.0,
};

/// The batch both sides train on: a 32-token prompt (loss mask 0) and a sampled response per
/// sequence, an advantage per sequence, and behaviour logprobs.
struct Batch {
    tokens: Vec<Vec<i64>>,
    loss_mask: Vec<Vec<u8>>,
    behaviour: Vec<Vec<f32>>,
    advantages: Vec<f64>,
}

impl Batch {
    /// `sequences` sequences of 96 to 160 tokens (`equal`: 128 each). The behaviour logprobs are
    /// the model's own, moved a little as an engine's would be (±0.05), and by 1 nat on every
    /// 16th sampled token, which the IS mask then drops (ρ = e⁻¹ < 0.5).
    fn new(model: &CausalLm, sequences: usize, equal: bool) -> Self {
        let vocab = model.config().vocab_size.min(2000) as i64;
        let tokens: Vec<Vec<i64>> = (0..sequences)
            .map(|i| {
                let len = if equal { 128 } else { 96 + (i * 37) % 65 };
                (0..len)
                    .map(|t| ((i * 7919 + t * 104_729) as i64) % vocab)
                    .collect()
            })
            .collect();
        let loss_mask: Vec<Vec<u8>> = tokens
            .iter()
            .map(|t| (0..t.len()).map(|j| u8::from(j >= PROMPT)).collect())
            .collect();
        let scored: Vec<SeqInput> = tokens
            .iter()
            .map(|t| SeqInput {
                slot: None,
                tokens: t,
                replay: None,
                images: &[],
            })
            .collect();
        let logp = tch::no_grad(|| token_logprobs(model, &scored, LOSS.temperature)).unwrap();
        let behaviour = (0..sequences)
            .map(|i| {
                let row: Vec<f32> = Vec::try_from(logp.get(i as i64)).unwrap();
                (0..tokens[i].len())
                    .map(|t| match t {
                        t if t < PROMPT => 0.0,
                        t if t % 16 == 0 => row[t] + 1.0,
                        t => row[t] + 0.05 * ((t * 7 + i) as f32).sin(),
                    })
                    .collect()
            })
            .collect();
        let advantages = (0..sequences)
            .map(|i| [1.5, -0.5, 0.75, -1.0][i % 4])
            .collect();
        Self {
            tokens,
            loss_mask,
            behaviour,
            advantages,
        }
    }

    fn token_count(&self) -> usize {
        self.tokens.iter().map(Vec::len).sum()
    }

    fn samples(&self) -> Vec<Sample> {
        (0..self.tokens.len())
            .map(|i| Sample {
                tokens: self.tokens[i].clone(),
                loss_mask: self.loss_mask[i].clone(),
                behaviour_logprobs: self.behaviour[i].clone(),
                advantage: self.advantages[i],
                token_advantages: None,
                replay: None,
                images: Vec::new(),
            })
            .collect()
    }
}

/// The phases of a step, in milliseconds: loss forward (π_old is its detached logprobs),
/// backward, optimizer (clipping, AdamW, zeroing the gradients).
type Phases = [f64; 3];

/// One side's measured steps, and the losses and gradient norms of its first two steps (from
/// the checkpoint's weights, and after one update).
#[derive(Default)]
struct Side {
    steps: Vec<Phases>,
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
}

impl Side {
    fn median_ms(&self) -> f64 {
        let totals: Vec<f64> = self.steps.iter().map(|p| p.iter().sum()).collect();
        quantile(&totals, 0.5)
    }

    fn median_phases(&self) -> Phases {
        std::array::from_fn(|i| quantile(&self.steps.iter().map(|p| p[i]).collect::<Vec<_>>(), 0.5))
    }
}

/// moult's step, as `trainer::train::Trainer::step` takes it for a batch in one micro-batch.
struct Moult {
    model: CausalLm,
    params: Vec<Tensor>,
    optimizer: AdamW,
}

impl Moult {
    fn new(model: CausalLm) -> Self {
        let params = model
            .trainable()
            .into_iter()
            .map(|t| t.set_requires_grad(true))
            .collect();
        Self {
            model,
            params,
            optimizer: AdamW::new(BETAS, ADAM_EPS, WEIGHT_DECAY),
        }
    }

    /// One step: its phases, the loss, the gradient norm before clipping.
    fn step(&mut self, samples: &[Sample]) -> (Phases, f64, f64) {
        let mut clock = Instant::now();
        let mut lap = || {
            let ms = clock.elapsed().as_secs_f64() * 1e3;
            clock = Instant::now();
            ms
        };
        let (loss, metrics) = policy_loss(&self.model, samples, &LOSS, None).unwrap();
        let loss_ms = lap();
        loss.backward();
        let backward_ms = lap();
        let grad_norm = clip_grad_norm(&self.params, MAX_GRAD_NORM);
        self.optimizer.step(&self.params, LR);
        for p in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let optimizer_ms = lap();
        (
            [loss_ms, backward_ms, optimizer_ms],
            metrics.loss,
            grad_norm,
        )
    }
}

/// A fresh PyTorch process taking `warmup` + `steps` steps from the checkpoint's weights; the
/// measured steps, the first two steps' losses and gradient norms, and the tokens it forwards
/// per step (padded).
fn pytorch_steps(
    dir: &Path,
    batch: &Batch,
    warmup: usize,
    steps: usize,
    threads: usize,
) -> (Side, usize) {
    let path = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-trainer-batch.json");
    let spec = json!({
        "tokens": batch.tokens,
        "loss_mask": batch.loss_mask,
        "behaviour_logprobs": batch.behaviour,
        "advantages": batch.advantages,
        "threads": threads,
        "warmup": warmup,
        "steps": steps,
        "temperature": LOSS.temperature,
        "eps_low": LOSS.eps_low,
        "eps_high": LOSS.eps_high,
        "is_low": 0.5,
        "is_high": 5.0,
        "lr": LR,
        "betas": [BETAS.0, BETAS.1],
        "adam_eps": ADAM_EPS,
        "weight_decay": WEIGHT_DECAY,
        "max_grad_norm": MAX_GRAD_NORM,
    });
    std::fs::write(&path, spec.to_string()).unwrap();
    let script = root().join("tests/python/bench_trainer_step.py");
    let out = run_python(&[
        script.to_str().unwrap(),
        dir.to_str().unwrap(),
        path.to_str().unwrap(),
    ]);
    let v: Value = serde_json::from_str(out.trim()).unwrap();
    let get = |key: &str| -> Vec<f64> { serde_json::from_value(v[key].clone()).unwrap() };
    assert_eq!(v["threads"].as_u64(), Some(threads as u64));
    let steps: Vec<Phases> = serde_json::from_value(v["phases_ms"].clone()).unwrap();
    (
        Side {
            steps,
            losses: get("losses")[..2].to_vec(),
            grad_norms: get("grad_norms")[..2].to_vec(),
        },
        v["padded_tokens"].as_u64().unwrap() as usize,
    )
}

/// One row of the tables: a model and a batch shape, and how many steps to time: `rounds` of
/// `steps` moult steps then `steps` PyTorch steps, so that both sides see the same background
/// load on a shared machine, each side warmed up with `warmup` steps first (the first steps run
/// several times slower: kernels are chosen and memory is faulted in).
struct Case {
    model: &'static str,
    dir: std::path::PathBuf,
    sequences: usize,
    equal: bool,
    rounds: usize,
    warmup: usize,
    steps: usize,
}

/// What one case measured.
struct Row {
    name: String,
    tokens: usize,
    padded: usize,
    ours: Side,
    theirs: Side,
}

fn measure(case: &Case, threads: usize) -> Row {
    let model = CausalLm::load(&case.dir, Kind::Float, Device::Cpu).unwrap();
    let batch = Batch::new(&model, case.sequences, case.equal);
    let samples = batch.samples();
    let mut moult = Moult::new(model);
    let (mut ours, mut theirs, mut padded) = (Side::default(), Side::default(), 0);
    // At least two: the first two steps' losses are compared.
    let warmup = case.warmup.max(2);
    for _ in 0..warmup {
        let (_, loss, grad_norm) = moult.step(&samples);
        ours.losses.push(loss);
        ours.grad_norms.push(grad_norm);
    }
    ours.losses.truncate(2);
    ours.grad_norms.truncate(2);
    for round in 0..case.rounds {
        for _ in 0..case.steps {
            ours.steps.push(moult.step(&samples).0);
        }
        let (side, p) = pytorch_steps(&case.dir, &batch, warmup, case.steps, threads);
        if round == 0 {
            theirs.losses = side.losses;
            theirs.grad_norms = side.grad_norms;
        }
        theirs.steps.extend(side.steps);
        padded = p;
    }
    let lengths = if case.equal { "128" } else { "96..160" };
    Row {
        name: format!("{}, {} x {lengths}", case.model, case.sequences),
        tokens: batch.token_count(),
        padded,
        ours,
        theirs,
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let threads = args
        .iter()
        .position(|a| a == "--threads")
        .and_then(|i| args.get(i + 1))
        .map(|n| n.parse().expect("--threads N"))
        .unwrap_or(1);
    tch::set_num_threads(threads as i32);

    let tiny = |equal| Case {
        model: "tiny (3 layers, d=64, vocab 2003)",
        dir: tiny_model(),
        sequences: 16,
        equal,
        rounds: if quick { 1 } else { 3 },
        warmup: 3,
        steps: 3,
    };
    let mut cases = vec![tiny(true), tiny(false)];
    if !quick {
        // Steps of this one take tens of seconds on 2 cores: a smaller batch, fewer steps.
        cases.push(Case {
            model: "Qwen3-0.6B width, 4 layers (vocab 151936)",
            dir: qwen3_width_model(4),
            sequences: 4,
            equal: true,
            rounds: 1,
            warmup: 2,
            steps: 3,
        });
    }
    println!("intra-op threads: {threads} on both sides");
    let rows: Vec<Row> = cases.iter().map(|c| measure(c, threads)).collect();

    println!();
    println!("| model, batch | tokens (PyTorch, padded) | steps | moult ms/step | PyTorch ms/step | PyTorch / moult |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        let (ours, theirs) = (r.ours.median_ms(), r.theirs.median_ms());
        println!(
            "| {} | {} ({}) | {} | {ours:.1} | {theirs:.1} | {:.2}x |",
            r.name,
            r.tokens,
            r.padded,
            r.ours.steps.len(),
            theirs / ours
        );
    }
    println!();
    println!("Median ms per phase, moult / PyTorch:");
    println!();
    println!("| model, batch | loss forward | backward | optimizer |");
    println!("| --- | --- | --- | --- |");
    for r in &rows {
        let (o, t) = (r.ours.median_phases(), r.theirs.median_phases());
        let cells: Vec<String> = (0..3)
            .map(|i| format!("{:.1} / {:.1}", o[i], t[i]))
            .collect();
        println!("| {} | {} |", r.name, cells.join(" | "));
    }
    println!();
    println!("| model, batch | step 1 loss: moult | PyTorch | abs diff | step 1 grad norm: moult | PyTorch | rel diff | step 2 loss: moult | PyTorch | abs diff |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for r in &rows {
        let (o, t) = (&r.ours, &r.theirs);
        println!(
            "| {} | {:.8} | {:.8} | {:.1e} | {:.6} | {:.6} | {:.1e} | {:.8} | {:.8} | {:.1e} |",
            r.name,
            o.losses[0],
            t.losses[0],
            (o.losses[0] - t.losses[0]).abs(),
            o.grad_norms[0],
            t.grad_norms[0],
            (o.grad_norms[0] - t.grad_norms[0]).abs() / t.grad_norms[0].abs().max(1e-12),
            o.losses[1],
            t.losses[1],
            (o.losses[1] - t.losses[1]).abs(),
        );
    }
    for r in &rows {
        let diff = (r.ours.losses[0] - r.theirs.losses[0]).abs();
        assert!(
            diff < 1e-4,
            "{}: the first step's losses disagree by {diff:e}",
            r.name
        );
    }
}
