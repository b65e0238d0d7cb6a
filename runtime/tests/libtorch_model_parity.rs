//! Numerical parity of our forward (Qwen3, Qwen3-MoE, Llama 3, Qwen2, Mistral, Gemma 3) with
//! Hugging Face transformers (libtorch).

mod common;

use moult_runtime::model::{CausalLm, LogitsFor, SeqInput};
use tch::{Device, Kind, Tensor};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
        .abs()
        .max()
        .double_value(&[])
}

fn check_parity(dir: &std::path::Path, packed: bool) {
    let mut model = CausalLm::load(dir, Kind::Float, Device::Cpu).unwrap();
    if packed {
        assert!(
            model.pack_for_inference(),
            "packing is available for f32 on CPU"
        );
    }
    let reference = common::reference(dir);
    assert!(
        reference.len() >= 3,
        "reference has prompts of several lengths"
    );
    let prompts: Vec<Vec<i64>> = reference.iter().map(|r| r.0.clone()).collect();
    let (logits, routed) = common::full_logits(&model, &prompts);
    let mut offset = 0;
    for (i, (prompt, hf_logits, hf_experts)) in reference.iter().enumerate() {
        let diff = max_abs_diff(&logits[i], hf_logits);
        assert!(
            diff < 1e-4,
            "prompt {i} (len {}): max |ours - transformers| = {diff:e}",
            prompt.len()
        );
        if let Some(hf_experts) = hf_experts {
            let ours = routed
                .as_ref()
                .unwrap()
                .narrow(0, offset, prompt.len() as i64);
            assert_eq!(ours.size(), hf_experts.size());
            assert!(
                ours.equal(hf_experts),
                "prompt {i}: routed experts differ from transformers' top-k"
            );
        }
        offset += prompt.len() as i64;
    }
}

#[test]
fn libtorch_dense_logits_match_transformers() {
    check_parity(&common::dense_model(), false);
}

#[test]
fn libtorch_moe_logits_and_routing_match_transformers() {
    check_parity(&common::moe_model(), false);
}

/// The engine's oneDNN-packed weights compute the same logits.
#[test]
fn libtorch_packed_weights_logits_match_transformers() {
    check_parity(&common::dense_model(), true);
    check_parity(&common::moe_model(), true);
}

/// Decoding with the KV cache, in chunks of mixed sizes and with sequences at different
/// positions in one packed batch, gives the same logits as one full forward; sequences that
/// finish free their slots (moving others) without disturbing the rest.
fn check_kv_cache(dir: &std::path::Path) {
    let model = CausalLm::load(dir, Kind::Float, Device::Cpu).unwrap();
    let prompts: Vec<Vec<i64>> = common::reference(dir)
        .into_iter()
        .map(|r| r.0)
        .filter(|p| p.len() > 4)
        .collect();
    assert!(prompts.len() >= 3);
    let (full, _) = common::full_logits(&model, &prompts);
    // Capacity 2: the cache must grow while in use.
    let mut cache = model.new_cache(2);
    let mut slots: Vec<Option<usize>> = prompts.iter().map(|_| Some(cache.alloc())).collect();
    let mut fed = vec![0usize; prompts.len()];
    let mut got: Vec<Vec<Tensor>> = prompts.iter().map(|_| Vec::new()).collect();
    let mut step = 0;
    while slots.iter().any(Option::is_some) {
        // Per sequence: a prefill, a multi-token continuation (the masked path), then single
        // tokens (the batched decode path); offset by the sequence index so the batch is ragged.
        let mut seqs = Vec::new();
        let mut which = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let Some(slot) = slots[i] else { continue };
            let chunk = match step {
                0 => 2 + i,
                1 => 3,
                _ => 1,
            }
            .min(prompt.len() - fed[i]);
            seqs.push(SeqInput {
                tokens: &prompt[fed[i]..fed[i] + chunk],
                slot: Some(slot),
                replay: None,
                images: &[],
            });
            which.push((i, chunk));
        }
        let out = tch::no_grad(|| model.forward(&seqs, Some(&mut cache), LogitsFor::All)).unwrap();
        let mut row = 0;
        for (i, chunk) in which {
            got[i].push(out.logits.narrow(0, row, chunk as i64));
            row += chunk as i64;
            fed[i] += chunk;
            if fed[i] == prompts[i].len() {
                let slot = slots[i].take().unwrap();
                assert_eq!(cache.len(slot), prompts[i].len());
                if let Some(moved_from) = cache.free(slot) {
                    let moved = slots
                        .iter_mut()
                        .flatten()
                        .find(|s| **s == moved_from)
                        .unwrap();
                    *moved = slot;
                }
            }
        }
        step += 1;
    }
    assert_eq!(cache.used(), 0);
    for (i, parts) in got.iter().enumerate() {
        let cached = Tensor::cat(parts, 0);
        let diff = max_abs_diff(&cached, &full[i]);
        assert!(
            diff < 1e-4,
            "sequence {i}: KV-cache decoding differs from the full forward by {diff:e}"
        );
    }
}

/// The families that differ from Qwen3 by configuration (docs/models.md): packed logits equal
/// transformers' (dense and oneDNN-packed weights), KV-cache decoding equals the full forward,
/// and the trainer's logprobs equal the engine's path on the same model. Sliding windows (Mistral,
/// Gemma 3) are shorter than the longest prompt, so the trainer's masks and the cache's windowed
/// reads are both exercised.
#[test]
fn libtorch_llama_qwen2_mistral_and_gemma3_match_transformers() {
    for name in common::FAMILIES {
        let dir = common::family_models().join(name);
        check_parity(&dir, false);
        check_parity(&dir, true);
        check_kv_cache(&dir);
        println!("{name}: logits and KV-cache decoding match transformers");
    }
}

#[test]
fn libtorch_dense_kv_cache_decoding_matches_full_forward() {
    check_kv_cache(&common::dense_model());
}

#[test]
fn libtorch_moe_kv_cache_decoding_matches_full_forward() {
    check_kv_cache(&common::moe_model());
}

#[test]
fn libtorch_moe_replay_reproduces_and_overrides_routing() {
    let dir = common::moe_model();
    let model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let (prompt, hf_logits, hf_experts) = common::reference(&dir).pop().unwrap();
    let hf_experts = hf_experts.unwrap();
    let run = |replay: &Tensor| {
        let seqs = [SeqInput {
            tokens: &prompt,
            slot: None,
            replay: Some(replay),
            images: &[],
        }];
        tch::no_grad(|| model.forward(&seqs, None, LogitsFor::All)).unwrap()
    };
    let same = run(&hf_experts);
    assert!(
        max_abs_diff(&same.logits, &hf_logits) < 1e-4,
        "replaying the model's own routing changes nothing"
    );
    assert!(same.routed_experts.unwrap().equal(&hf_experts));

    // A different routing (every expert id shifted by one) must change the output: the
    // replayed experts are really used.
    let shifted = (&hf_experts + 1).remainder(8);
    let other = run(&shifted);
    assert!(other.routed_experts.unwrap().equal(&shifted));
    assert!(
        max_abs_diff(&other.logits, &hf_logits) > 1e-3,
        "replayed routing was ignored"
    );

    let bad = hf_experts.narrow(1, 0, 1);
    let seqs = [SeqInput {
        tokens: &prompt,
        slot: None,
        replay: Some(&bad),
        images: &[],
    }];
    let err = model
        .forward(&seqs, None, LogitsFor::All)
        .unwrap_err()
        .to_string();
    assert!(err.contains("expected"), "{err}");
}

#[test]
fn libtorch_bf16_runs_close_to_f32() {
    let dir = common::dense_model();
    let f32_model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let bf16_model = CausalLm::load(&dir, Kind::BFloat16, Device::Cpu).unwrap();
    let prompt = common::reference(&dir).pop().unwrap().0;
    let (a, _) = common::full_logits(&f32_model, std::slice::from_ref(&prompt));
    let (b, _) = common::full_logits(&bf16_model, std::slice::from_ref(&prompt));
    assert_eq!(b[0].kind(), Kind::BFloat16);
    let scale = a[0].abs().max().double_value(&[]);
    let diff = max_abs_diff(&a[0], &b[0]);
    assert!(
        diff < 0.05 * scale,
        "bf16 logits drift {diff} vs scale {scale}"
    );
}

#[test]
fn libtorch_checkpoint_mismatch_is_refused_by_name() {
    let dir = common::dense_model();
    let tmp = tempdir("mismatch");
    std::fs::copy(dir.join("config.json"), tmp.join("config.json")).unwrap();
    let mut weights = Tensor::read_safetensors(dir.join("model.safetensors")).unwrap();
    weights.retain(|(name, _)| name != "model.layers.1.self_attn.k_norm.weight");
    Tensor::write_safetensors(&weights, tmp.join("model.safetensors")).unwrap();
    let err = CausalLm::load(&tmp, Kind::Float, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.1.self_attn.k_norm.weight") && err.contains("missing"),
        "{err}"
    );

    weights.push((
        "model.layers.1.self_attn.k_norm.weight".into(),
        Tensor::ones([16], (Kind::Float, Device::Cpu)),
    ));
    weights.push((
        "model.layers.0.self_attn.q_proj.bias".into(),
        Tensor::zeros([64], (Kind::Float, Device::Cpu)),
    ));
    Tensor::write_safetensors(&weights, tmp.join("model.safetensors")).unwrap();
    let err = CausalLm::load(&tmp, Kind::Float, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("q_proj.bias") && err.contains("not used"),
        "{err}"
    );
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
