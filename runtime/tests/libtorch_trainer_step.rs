//! The policy loss learns (libtorch): on-policy, a sequence with a positive advantage becomes
//! more likely and one with a negative advantage less, under each loss and on each family's
//! forward (Gemma 3's norms, windows and soft-capping included); on-policy means no
//! engine/trainer mismatch (|log ρ| = 0, nothing masked).

mod common;

use common::{dense_model, moe_model};
use moult_runtime::algorithms::correction::{Correction, Level, Mode};
use moult_runtime::algorithms::losses::Aggregation;
use moult_runtime::model::CausalLm;
use moult_runtime::model::SeqInput;
use moult_runtime::trainer::logprobs::token_logprobs;
use moult_runtime::trainer::optim::{clip_grad_norm, AdamW};
use moult_runtime::trainer::step::{policy_loss, LossConfig, LossKind, Sample};
use tch::{Device, Kind, Tensor};

/// Mean logprob of each sequence's sampled tokens.
fn sampled_mean(model: &CausalLm, seqs: &[(Vec<i64>, Vec<u8>)]) -> Vec<f64> {
    let scored: Vec<SeqInput> = seqs
        .iter()
        .map(|(t, _)| SeqInput {
            slot: None,
            tokens: t,
            replay: None,
            images: &[],
        })
        .collect();
    let lp = tch::no_grad(|| token_logprobs(model, &scored, 1.0).unwrap());
    seqs.iter()
        .enumerate()
        .map(|(i, (_, m))| {
            let row: Vec<f32> = Vec::try_from(lp.get(i as i64)).unwrap();
            let (s, n) = m
                .iter()
                .zip(&row)
                .filter(|(&mm, _)| mm == 1)
                .fold((0.0, 0.0), |(s, n), (_, &v)| (s + v as f64, n + 1.0));
            s / n
        })
        .collect()
}

#[test]
fn libtorch_each_loss_moves_probability_toward_positive_advantages() {
    let runs = [LossKind::PpoClip, LossKind::Gspo, LossKind::Cispo]
        .into_iter()
        .map(|kind| (dense_model(), kind))
        .chain(
            ["mistral-tiny-window", "gemma3-tiny", "gemma3-tiny-linear"]
                .map(|name| (common::family_models().join(name), LossKind::PpoClip)),
        );
    for (dir, kind) in runs {
        let model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
        let run = format!("{} {kind:?}", dir.file_name().unwrap().to_string_lossy());
        let params: Vec<Tensor> = model
            .trainable()
            .into_iter()
            .map(|t| t.set_requires_grad(true))
            .collect();
        // Longer than the windowed models' windows (5 and 8).
        let prompt: Vec<i64> = vec![2001, 273, 105, 94, 50, 253, 17, 900, 431, 12, 66];
        let good: Vec<i64> = prompt.iter().copied().chain([76, 435, 25, 295]).collect();
        let bad: Vec<i64> = prompt
            .iter()
            .copied()
            .chain([134, 122, 156, 1287])
            .collect();
        let mask: Vec<u8> = std::iter::repeat_n(0, prompt.len())
            .chain(std::iter::repeat_n(1, 4))
            .collect();
        let seqs = vec![(good, mask.clone()), (bad, mask)];
        let before = sampled_mean(&model, &seqs);
        // On-policy: the behaviour logprobs are the model's own.
        let scored: Vec<SeqInput> = seqs
            .iter()
            .map(|(t, _)| SeqInput {
                slot: None,
                tokens: t,
                replay: None,
                images: &[],
            })
            .collect();
        let behaviour = tch::no_grad(|| token_logprobs(&model, &scored, 1.0).unwrap());
        let rows: Vec<Vec<f32>> = (0..2)
            .map(|i| Vec::try_from(behaviour.get(i)).unwrap())
            .collect();
        let cfg = LossConfig {
            kind,
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
        let mut opt = AdamW::new((0.9, 0.999), 1e-8, 0.0);
        for step in 0..8 {
            let samples: Vec<Sample> = seqs
                .iter()
                .zip(&rows)
                .zip([1.0, -1.0])
                .map(|(((t, m), b), a)| Sample {
                    tokens: t.clone(),
                    loss_mask: m.clone(),
                    behaviour_logprobs: b.clone(),
                    advantage: a,
                    token_advantages: None,
                    replay: None,
                    images: Vec::new(),
                })
                .collect();
            let (loss, metrics) = policy_loss(&model, &samples, &cfg, None).unwrap();
            if step == 0 {
                assert!(metrics.mean_abs_log_rho < 1e-5, "{run}: on-policy");
                assert_eq!(metrics.masked_fraction, 0.0);
                assert_eq!(metrics.tokens, 8.0);
            }
            loss.backward();
            clip_grad_norm(&params, 1.0);
            opt.step(&params, 1e-2);
            for p in &params {
                let mut g = p.grad();
                let _ = g.zero_();
            }
        }
        let after = sampled_mean(&model, &seqs);
        assert!(
            after[0] > before[0],
            "{run}: the rewarded sequence became likelier ({} -> {})",
            before[0],
            after[0]
        );
        assert!(
            after[1] < before[1],
            "{run}: the penalised one less likely ({} -> {})",
            before[1],
            after[1]
        );
    }
}

#[test]
fn libtorch_trainable_tensors_cover_every_named_weight_once() {
    let families = common::FAMILIES.map(|name| common::family_models().join(name));
    for dir in [dense_model(), moe_model()].into_iter().chain(families) {
        let model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
        let elements: i64 = model.trainable().iter().map(|t| t.numel() as i64).sum();
        let params = model.params();
        let named: i64 = params.values().map(|t| t.numel() as i64).sum();
        // A tied LM head is the embedding's storage, named twice but trained once.
        let tied = params
            .get("lm_head.weight")
            .filter(|h| h.data_ptr() == params["model.embed_tokens.weight"].data_ptr());
        let expected = named - tied.map_or(0, |h| h.numel() as i64);
        assert_eq!(elements, expected, "{}", dir.display());
        let mut ptrs: Vec<usize> = model
            .trainable()
            .iter()
            .map(|t| t.data_ptr() as usize)
            .collect();
        ptrs.sort();
        ptrs.dedup();
        assert_eq!(ptrs.len(), model.trainable().len(), "each storage once");
    }
}

/// A NaN in the batch (here the advantage; a NaN reward becomes one) makes the loss and every
/// gradient NaN: the step is skipped, the weights stay finite and unchanged, and the next good
/// batch trains as usual.
#[test]
fn libtorch_a_non_finite_loss_skips_the_update_and_keeps_the_weights_finite() {
    use moult_runtime::trainer::train::{Sample, Trainer};
    let mut trainer = tiny_trainer();
    let batch = |advantage: f64| {
        vec![Sample {
            tokens: vec![2001, 273, 105, 94, 76, 435],
            loss_mask: vec![0, 0, 0, 0, 1, 1],
            behaviour_logprobs: vec![0.0, 0.0, 0.0, 0.0, -3.0, -3.0],
            advantage,
            token_advantages: None,
            replay: None,
            images: Vec::new(),
        }]
    };
    let snapshot = |t: &Trainer| -> Vec<Tensor> {
        t.weights().unwrap().iter().map(|(_, w)| w.copy()).collect()
    };
    let before = snapshot(&trainer);
    let stats = trainer.step(&batch(f64::NAN)).unwrap();
    assert!(stats.skipped, "{stats:?}");
    let after = snapshot(&trainer);
    for (b, a) in before.iter().zip(&after) {
        assert!(bool::try_from(a.isfinite().all()).unwrap(), "a NaN weight");
        assert!(a.equal(b), "a skipped step changed a weight");
    }
    // The gradients were cleared: the next good step moves the weights, and stays finite.
    let stats = trainer.step(&batch(1.0)).unwrap();
    assert!(!stats.skipped && stats.grad_norm.is_finite(), "{stats:?}");
    let moved = snapshot(&trainer);
    assert!(moved.iter().zip(&after).any(|(m, a)| !m.equal(a)));
    assert!(moved
        .iter()
        .all(|m| bool::try_from(m.isfinite().all()).unwrap()));
}

/// A PPO trainer of the tiny dense model with a constant learning rate.
fn tiny_trainer() -> moult_runtime::trainer::train::Trainer {
    use moult_runtime::trainer::optim::{Decay, LrSchedule};
    use moult_runtime::trainer::train::{Trainer, TrainerOptions};
    let model = CausalLm::load(&dense_model(), Kind::Float, Device::Cpu).unwrap();
    let opts = TrainerOptions {
        loss: LossConfig {
            kind: LossKind::PpoClip,
            eps_low: 0.2,
            eps_high: 0.28,
            aggregation: Aggregation::TokenMean,
            correction: None,
            temperature: 1.0,
        },
        schedule: LrSchedule {
            peak: 1e-2,
            warmup_steps: 0,
            total_steps: 10,
            decay: Decay::Constant,
            min_ratio: 1.0,
        },
        weight_decay: 0.0,
        max_grad_norm: Some(1.0),
        micro_batch_tokens: 1024,
        kl_coef: 0.0,
        sharding: Default::default(),
        bf16_compute: false,
        freeze_vision: false,
        lora: None,
    };
    Trainer::new(model, None, opts).unwrap()
}

/// A tmpfs of `bytes` mounted at a fresh folder for the life of the value (needs root, as CI and
/// the developer machines have; `None` where mounting is not allowed).
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(bytes: u64) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!("moult-tmpfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .status()
            .is_ok_and(|s| s.success());
        mounted.then_some(Self(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

fn folder_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

/// A disk that fills up while a checkpoint is written: the save prunes older checkpoints and
/// succeeds; when even that leaves no room, it fails without touching the newest complete
/// checkpoint, which a restart then resumes from, and leaves no partial folder behind.
#[test]
fn libtorch_a_full_disk_never_loses_the_last_good_checkpoint() {
    use moult_runtime::learner::checkpoint::{latest, save, CheckpointMeta};
    let trainer = tiny_trainer();
    let model = dense_model();
    let meta = |step: u64| CheckpointMeta {
        step,
        policy_version: step,
        rollout: Default::default(),
        seed: 7,
    };
    let probe = std::env::temp_dir().join(format!("moult-ckpt-probe-{}", std::process::id()));
    let one = folder_bytes(&save(&probe, &model, &trainer, &meta(1)).unwrap());
    std::fs::remove_dir_all(&probe).unwrap();

    // Room for two checkpoints and a half: the third save fills the disk, prunes, and succeeds.
    let Some(disk) = Tmpfs::mount(one * 5 / 2) else {
        eprintln!("skipped: cannot mount a tmpfs here (needs root)");
        return;
    };
    let root = disk.0.join("checkpoints");
    for step in 1..=3 {
        save(&root, &model, &trainer, &meta(step)).unwrap();
    }
    let (dir, found) = latest(&root).unwrap().unwrap();
    assert_eq!(found, meta(3));
    assert!(dir.ends_with("step-000003"));
    assert!(!root.join("step-000001").exists(), "pruned to make room");

    // Fill what is left: now even pruning leaves no room for another checkpoint.
    let filler = disk.0.join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    let block = vec![0u8; 64 << 10];
    while std::io::Write::write_all(&mut f, &block).is_ok() {}
    drop(f);
    let err = save(&root, &model, &trainer, &meta(4)).unwrap_err();
    assert!(err.to_string().contains("No space left"), "{err}");
    let (dir, found) = latest(&root).unwrap().unwrap();
    assert_eq!(found, meta(3), "the newest complete checkpoint survives");
    assert_eq!(folder_bytes(&dir), one);
    let leftovers: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(".step-"))
        .collect();
    assert!(leftovers.is_empty(), "partial folders left: {leftovers:?}");
    // The weights it holds load.
    let loaded = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    drop(loaded);
}
