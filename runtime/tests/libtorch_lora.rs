//! LoRA adapters (docs/lora.md) against PEFT (PyPI `peft`, the Hugging Face reference): moult's
//! forward with an adapter PEFT wrote computes PEFT's logits, dense and MoE (experts adapted one
//! by one), packed or not; a new adapter computes the base model exactly; an adapter moult
//! writes loads in PEFT and computes moult's logits.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use moult_runtime::model::lora::{self, LoraConfig, TARGETS};
use moult_runtime::model::{CausalLm, LogitsFor, SeqInput};
use tch::{Device, Kind, Tensor};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
        .abs()
        .max()
        .double_value(&[])
}

/// Full packed forward of the prompts, split back per prompt.
fn logits(model: &CausalLm, prompts: &[Vec<i64>]) -> Vec<Tensor> {
    common::full_logits(model, prompts).0
}

/// The prompts and logits of a `reference.safetensors`.
fn reference(dir: &Path) -> Vec<(Vec<i64>, Tensor)> {
    (common::reference(dir).into_iter())
        .map(|(p, l, _)| (p, l))
        .collect()
}

/// The base model of `adapter` (an adapter folder of `common::lora_adapters`) with it attached,
/// through `CausalLm::load` of the adapter folder, as engines and trainers load it.
fn check_against_peft(adapter: &str, packed: bool) {
    let dir = common::lora_adapters().join(adapter);
    let mut model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    assert!(model.lora().is_some(), "{adapter}: loaded as an adapter");
    if packed {
        assert!(model.pack_for_inference());
    }
    let reference = reference(&dir);
    assert!(reference.len() >= 3, "prompts of several lengths");
    let prompts: Vec<Vec<i64>> = reference.iter().map(|r| r.0.clone()).collect();
    let base = CausalLm::load(&common::dense_model(), Kind::Float, Device::Cpu).unwrap();
    for (i, ours) in logits(&model, &prompts).iter().enumerate() {
        let diff = max_abs_diff(ours, &reference[i].1);
        assert!(
            diff < 1e-4,
            "{adapter} prompt {i}: max |moult - PEFT| = {diff:e}"
        );
        if adapter == "dense" {
            let moved = max_abs_diff(&logits(&base, &prompts)[i], &reference[i].1);
            assert!(moved > 1e-2, "the adapter changes the logits ({moved:e})");
        }
    }
}

#[test]
fn libtorch_lora_dense_logits_match_peft() {
    check_against_peft("dense", false);
    check_against_peft("dense", true);
}

#[test]
fn libtorch_lora_moe_experts_logits_match_peft() {
    check_against_peft("moe-2d", false);
}

fn all_targets(rank: i64) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        rslora: false,
        dropout: 0.0,
        targets: TARGETS.map(String::from).into(),
    }
}

/// A new adapter is PEFT's initialisation: `B = 0`, so the model computes the base exactly;
/// its tensors are the trainable ones, under PEFT's names, one unit per layer.
#[test]
fn libtorch_lora_new_adapter_computes_the_base_and_is_all_that_trains() {
    for dir in [common::dense_model(), common::moe_model()] {
        let base = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
        let mut model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
        model.attach_lora(&all_targets(4), None, 7).unwrap();
        let prompts = vec![vec![1, 2, 3, 4, 5], vec![9; 17]];
        for (a, b) in logits(&model, &prompts).iter().zip(logits(&base, &prompts)) {
            assert!(a.equal(&b), "B = 0: the base's logits, bit for bit");
        }
        let trainable = model.trainable();
        let names = model.named_slices();
        assert_eq!(names.len(), trainable.len(), "one name per adapter tensor");
        assert!(names
            .iter()
            .all(|n| n.name.starts_with("base_model.model.model.layers.")
                && (n.name.ends_with(".lora_A.weight") || n.name.ends_with(".lora_B.weight"))));
        let layers = model.config().num_hidden_layers;
        assert_eq!(model.trainable_units().len(), layers);
        let units_cover: usize = model.trainable_units().iter().map(|u| u.len()).sum();
        assert_eq!(units_cover, trainable.len());
        // The same seed makes the same adapter (every rank of a trainer starts alike).
        let mut again = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
        again.attach_lora(&all_targets(4), None, 7).unwrap();
        for (a, b) in trainable.iter().zip(again.trainable()) {
            assert!(a.equal(&b));
        }
    }
}

/// An adapter moult writes (after changing its `B`s, as training does) loads in PEFT, which
/// computes moult's logits, and loads back in moult.
#[test]
fn libtorch_lora_adapter_moult_writes_loads_in_peft() {
    for (name, dir) in [
        ("dense", common::dense_model()),
        ("moe", common::moe_model()),
    ] {
        let mut model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
        let config = LoraConfig {
            // PEFT 0.21.2 scales a per-expert rsLoRA adapter wrongly once it has fused it
            // (docs/lora.md): rsLoRA is checked on the dense model.
            rslora: name == "dense",
            ..all_targets(4)
        };
        model.attach_lora(&config, None, 3).unwrap();
        tch::manual_seed(5);
        let dense_mlp = |n: &str| name == "moe" && n.contains(".layers.1.mlp.");
        tch::no_grad(|| {
            for (n, t) in model.params() {
                // PEFT drops a MoE model's dense-MLP adapters (make_lora_adapters.py): zero.
                let scale = if dense_mlp(n) { 0.0 } else { 0.1 };
                t.shallow_clone().copy_(&(t.randn_like() * scale));
            }
        });
        let out = std::env::temp_dir().join(format!("moult-lora-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        let weights: Vec<(String, Tensor)> = (model.params().iter())
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        lora::write_adapter(&out, &config, &dir, &weights).unwrap();
        let scores = out.join("peft.safetensors");
        let status = std::process::Command::new(common::python())
            .arg(common::repo_root().join("tests/python/make_lora_adapters.py"))
            .args([
                "--score".as_ref(),
                dir.as_os_str(),
                out.as_os_str(),
                scores.as_os_str(),
            ])
            .status()
            .unwrap();
        assert!(status.success(), "PEFT loads the adapter moult wrote");
        let peft: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&scores)
            .unwrap()
            .into_iter()
            .collect();
        let prompts: Vec<Vec<i64>> = reference(&dir).into_iter().map(|r| r.0).collect();
        let reloaded = CausalLm::load(&out, Kind::Float, Device::Cpu).unwrap();
        assert_eq!(reloaded.lora(), Some(&config));
        let ours = logits(&model, &prompts);
        for (i, (a, b)) in ours.iter().zip(logits(&reloaded, &prompts)).enumerate() {
            let diff = max_abs_diff(a, &peft[&format!("logits_{i}")]);
            assert!(
                diff < 1e-4,
                "{name} prompt {i}: max |moult - PEFT| = {diff:e}"
            );
            assert!(a.equal(&b), "{name}: moult reads back what it wrote");
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// What moult does not compute is refused, naming what is accepted.
#[test]
fn libtorch_lora_refuses_what_it_does_not_compute() {
    let mut model = CausalLm::load(&common::dense_model(), Kind::Float, Device::Cpu).unwrap();
    let bad = LoraConfig {
        targets: vec!["lm_head".into()],
        ..all_targets(4)
    };
    let err = model.attach_lora(&bad, None, 0).unwrap_err().to_string();
    assert!(
        err.contains("`lm_head`") && err.contains("q_proj, k_proj"),
        "{err}"
    );
    let config = serde_json::json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
        "target_modules": ["q_proj"], "use_dora": true});
    let err = LoraConfig::from_peft(&config, Path::new("adapter_config.json"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("use_dora"), "{err}");
    // An adapter whose tensors do not fit the model's shapes.
    let mut weights = std::collections::BTreeMap::new();
    let q = "base_model.model.model.layers.0.self_attn.q_proj";
    weights.insert(
        format!("{q}.lora_A.weight"),
        Tensor::zeros([4, 3], (Kind::Float, Device::Cpu)),
    );
    let only_q = LoraConfig {
        targets: vec!["q_proj".into()],
        ..all_targets(4)
    };
    let err = model
        .attach_lora(&only_q, Some(weights), 0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lora_A.weight") && err.contains("[4, 64]"),
        "{err}"
    );
}

/// A model with random adapter tensors of shape `config` (as training leaves them), by PEFT name.
fn random_adapter(
    dir: &Path,
    config: &LoraConfig,
    seed: i64,
) -> (CausalLm, BTreeMap<String, Tensor>) {
    let mut model = CausalLm::load(dir, Kind::Float, Device::Cpu).unwrap();
    model.attach_lora(config, None, seed as u64).unwrap();
    tch::manual_seed(seed);
    tch::no_grad(|| {
        for t in model.params().values() {
            t.shallow_clone().copy_(&(t.randn_like() * 0.1));
        }
    });
    let weights = (model.params().iter())
        .map(|(n, t)| (n.clone(), t.copy()))
        .collect();
    (model, weights)
}

/// Several adapters in one forward (the engine's batches, docs/lora.md): a packed batch mixing
/// the base, a PEFT adapter and a moult one (different targets and ranks) computes for each
/// sequence what it computes alone with its adapter, without a cache and through the engine's
/// KV cache in ragged chunks (prefill, a multi-token continuation, single-token decodes); with
/// oneDNN-packed weights too. A slot dropped is refused by name.
#[test]
fn libtorch_lora_several_adapters_share_one_forward() {
    for (dir, peft) in [
        (common::dense_model(), "dense"),
        (common::moe_model(), "moe-2d"),
    ] {
        let peft_dir = common::lora_adapters().join(peft);
        let only_attention = LoraConfig {
            targets: vec!["q_proj".into(), "o_proj".into(), "down_proj".into()],
            ..all_targets(8)
        };
        let (second, second_weights) = random_adapter(&dir, &only_attention, 21);
        let alone = [
            CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap(),
            CausalLm::load(&peft_dir, Kind::Float, Device::Cpu).unwrap(),
            second,
        ];
        for packed in [false, true] {
            let mut model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
            let (config, _, weights) =
                lora::read_adapter(&peft_dir, Kind::Float, Device::Cpu).unwrap();
            model.load_adapter(1, &config, weights).unwrap();
            model
                .load_adapter(
                    2,
                    &only_attention,
                    second_weights
                        .iter()
                        .map(|(n, t)| (n.clone(), t.copy()))
                        .collect(),
                )
                .unwrap();
            if packed {
                assert!(model.pack_for_inference());
            }
            let prompts: Vec<Vec<i64>> = (0..5)
                .map(|i| {
                    (0..(6 + 3 * i))
                        .map(|j| (i * 211 + j * 37) % 2000)
                        .collect()
                })
                .collect();
            // Which model each prompt runs on: 0 base, 1 and 2 the adapters' slots.
            let which = [0usize, 1, 2, 1, 0];
            let adapters: Vec<Option<usize>> =
                which.iter().map(|&w| (w > 0).then_some(w)).collect();
            let expected: Vec<Tensor> = (prompts.iter().zip(which))
                .map(|(p, w)| {
                    common::full_logits(&alone[w], std::slice::from_ref(p))
                        .0
                        .remove(0)
                })
                .collect();
            // No cache: one forward of all five.
            let (mixed, _) = common::full_logits_with(&model, &prompts, &adapters);
            for (i, got) in mixed.iter().enumerate() {
                let diff = max_abs_diff(got, &expected[i]);
                assert!(
                    diff < 1e-4,
                    "{peft} packed {packed}: prompt {i} on {} differs by {diff:e}",
                    which[i]
                );
            }
            // The KV cache in ragged chunks.
            let mut cache = model.new_cache(4);
            let slots: Vec<usize> = prompts.iter().map(|_| cache.alloc()).collect();
            let mut fed = vec![0usize; prompts.len()];
            for step in 0.. {
                let (mut seqs, mut chosen, mut parts) = (Vec::new(), Vec::new(), Vec::new());
                for (i, prompt) in prompts.iter().enumerate() {
                    let chunk = match step {
                        0 => 2 + i,
                        1 => 3,
                        _ => 1,
                    }
                    .min(prompt.len() - fed[i]);
                    if chunk == 0 {
                        continue;
                    }
                    seqs.push(SeqInput {
                        tokens: &prompt[fed[i]..fed[i] + chunk],
                        slot: Some(slots[i]),
                        replay: None,
                        images: &[],
                    });
                    chosen.push(adapters[i]);
                    parts.push((i, chunk));
                }
                if seqs.is_empty() {
                    break;
                }
                let out = tch::no_grad(|| {
                    model.forward_adapters(&seqs, &chosen, Some(&mut cache), LogitsFor::All)
                })
                .unwrap();
                let mut row = 0;
                for (i, chunk) in parts {
                    let got = out.logits.narrow(0, row, chunk as i64);
                    let want = expected[i].narrow(0, fed[i] as i64, chunk as i64);
                    let diff = max_abs_diff(&got, &want);
                    assert!(diff < 1e-4, "{peft} packed {packed}, cached step {step}: prompt {i} differs by {diff:e}");
                    row += chunk as i64;
                    fed[i] += chunk;
                }
            }
            // A dropped slot holds nothing: asking for it is refused.
            model.drop_adapter(2);
            let first = SeqInput {
                tokens: &prompts[0],
                slot: None,
                replay: None,
                images: &[],
            };
            let err = model
                .forward_adapters(&[first], &[Some(2)], None, LogitsFor::All)
                .unwrap_err()
                .to_string();
            assert!(err.contains("adapter slot 2 holds no adapter"), "{err}");
        }
    }
}
