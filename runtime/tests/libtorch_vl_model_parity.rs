//! Numerical parity of our Qwen2.5-VL forward with Hugging Face transformers, with images
//! (libtorch): a tiny random model made by `tests/python/make_vl_model.py` (docs/vision.md).

mod common;

use std::path::Path;
use std::sync::Arc;

use moult_runtime::model::{CausalLm, ImageInput, LogitsFor, SeqInput};
use moult_runtime::vision::{preprocess_bytes, ImageProcessorConfig};
use tch::{Device, Kind, Tensor};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Float) - b.to_kind(Kind::Float))
        .abs()
        .max()
        .double_value(&[])
}

/// One reference prompt: its ids (the processor's, then forced text tokens), the processor's
/// length, transformers' logits, and its images, preprocessed by moult and placed.
struct Case {
    tokens: Vec<i64>,
    prompt_len: usize,
    logits: Tensor,
    images: Vec<ImageInput>,
}

/// The reference prompts, with each image preprocessed from its PNG by `moult_runtime::vision`
/// and checked against the processor's `pixel_values` and `image_grid_thw` first.
fn cases(model: &CausalLm, dir: &Path) -> Vec<Case> {
    let tensors: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("reference.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let processor = ImageProcessorConfig::from_model_dir(dir).unwrap();
    assert_eq!(model.image_processor(), Some(&processor));
    manifest
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, entry)| {
            let tokens = Vec::<i64>::try_from(&tensors[&format!("prompt_{i}")]).unwrap();
            let prompt_len = tensors[&format!("prompt_len_{i}")].int64_value(&[0]) as usize;
            let images: Vec<Arc<_>> = entry["images"]
                .as_array()
                .unwrap()
                .iter()
                .map(|f| {
                    let bytes = std::fs::read(dir.join(f.as_str().unwrap())).unwrap();
                    Arc::new(preprocess_bytes(&bytes, &processor).unwrap())
                })
                .collect();
            if !images.is_empty() {
                let grids: Vec<Vec<i64>> = images
                    .iter()
                    .map(|im| im.grid_thw.iter().map(|&d| d as i64).collect())
                    .collect();
                let hf_grids = Vec::<Vec<i64>>::try_from(&tensors[&format!("grid_{i}")]).unwrap();
                assert_eq!(grids, hf_grids, "prompt {i}: image grids");
                let ours: Vec<f32> = images
                    .iter()
                    .flat_map(|im| im.pixel_values.iter().copied())
                    .collect();
                let hf = &tensors[&format!("pixel_values_{i}")];
                let diff = max_abs_diff(&Tensor::from_slice(&ours).view_as(hf), hf);
                assert!(diff <= 1e-6, "prompt {i}: pixel_values differ by {diff:e}");
            }
            Case {
                images: model.place_images(&tokens, images).unwrap(),
                tokens,
                prompt_len,
                logits: tensors[&format!("logits_{i}")].shallow_clone(),
            }
        })
        .collect()
}

fn full_logits(model: &CausalLm, seqs: &[(&[i64], &[ImageInput])]) -> Vec<Tensor> {
    let inputs: Vec<SeqInput> = seqs
        .iter()
        .map(|&(tokens, images)| SeqInput {
            tokens,
            slot: None,
            replay: None,
            images,
        })
        .collect();
    let out = tch::no_grad(|| model.forward(&inputs, None, LogitsFor::All)).unwrap();
    let lens: Vec<i64> = seqs.iter().map(|s| s.0.len() as i64).collect();
    out.logits.split_with_sizes(&lens, 0)
}

/// Our logits equal transformers' within 1e-4 (float32) for a prompt without an image, with one,
/// and with two of different sizes (windows partial at the edges), each alone and all three
/// packed in one batch; the images are what makes them so (the same ids without their images
/// miss by far).
#[test]
fn libtorch_qwen2_5_vl_logits_match_transformers_with_images() {
    let dir = common::vl_model();
    let model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let cases = cases(&model, &dir);
    assert_eq!(
        cases.iter().map(|c| c.images.len()).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    let all: Vec<(&[i64], &[ImageInput])> = cases
        .iter()
        .map(|c| (&c.tokens[..], &c.images[..]))
        .collect();
    let packed = full_logits(&model, &all);
    for (i, case) in cases.iter().enumerate() {
        let alone = &full_logits(&model, &[all[i]])[0];
        let diff = max_abs_diff(alone, &case.logits);
        let diff_packed = max_abs_diff(&packed[i], &case.logits);
        println!(
            "prompt {i} ({} images, {} tokens): max |ours - transformers| = {diff:.2e} alone, {diff_packed:.2e} packed",
            case.images.len(),
            case.tokens.len()
        );
        assert!(diff < 1e-4 && diff_packed < 1e-4, "prompt {i}");
        if !case.images.is_empty() {
            let blind = &full_logits(&model, &[(&case.tokens[..], &[])])[0];
            let miss = max_abs_diff(blind, &case.logits);
            assert!(
                miss > 0.1,
                "prompt {i}: without its images it misses by only {miss:e}"
            );
        }
    }
}

/// The engine's path: prefill in ragged chunks that cut through the images' placeholders, then
/// the forced tokens decoded one at a time, three sequences sharing the cache, gives the full
/// forward's logits (transformers' within 1e-4): positions after an image are offset as
/// transformers' `rope_deltas` offsets them.
#[test]
fn libtorch_qwen2_5_vl_kv_cache_decoding_matches_transformers() {
    let dir = common::vl_model();
    let model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let cases = cases(&model, &dir);
    let mut cache = model.new_cache(4);
    let slots: Vec<usize> = cases.iter().map(|_| cache.alloc()).collect();
    let mut fed = vec![0usize; cases.len()];
    let mut got: Vec<Vec<Tensor>> = cases.iter().map(|_| Vec::new()).collect();
    let mut step = 0;
    while fed.iter().zip(&cases).any(|(&f, c)| f < c.tokens.len()) {
        let mut seqs = Vec::new();
        let mut which = Vec::new();
        for (i, case) in cases.iter().enumerate() {
            if fed[i] == case.tokens.len() {
                continue;
            }
            // Prefill chunks of 3 + i + step tokens, then one token at a time.
            let chunk = if fed[i] < case.prompt_len {
                (3 + i + step).min(case.prompt_len - fed[i])
            } else {
                1
            };
            seqs.push(SeqInput {
                tokens: &case.tokens[fed[i]..fed[i] + chunk],
                slot: Some(slots[i]),
                replay: None,
                images: &case.images,
            });
            which.push((i, chunk));
        }
        let out = tch::no_grad(|| model.forward(&seqs, Some(&mut cache), LogitsFor::All)).unwrap();
        let mut row = 0;
        for (i, chunk) in which {
            got[i].push(out.logits.narrow(0, row, chunk as i64));
            row += chunk as i64;
            fed[i] += chunk;
        }
        step += 1;
    }
    for (i, case) in cases.iter().enumerate() {
        let cached = Tensor::cat(&got[i], 0);
        let diff = max_abs_diff(&cached, &case.logits);
        println!(
            "prompt {i}: KV-cache path (prefill chunks, then {} decoded tokens) vs transformers: {diff:.2e}",
            case.tokens.len() - case.prompt_len
        );
        assert!(diff < 1e-4, "prompt {i}: {diff:e}");
    }
}

/// The trainer's side: the stages compose to the forward; the vision tower is the last unit of
/// trainable tensors, which cover every named weight once; a frozen tower gets no gradient (so
/// AdamW leaves it alone) while the text model does, and an unfrozen one gets its gradient.
#[test]
fn libtorch_qwen2_5_vl_trains_with_a_frozen_or_trainable_vision_tower() {
    let dir = common::vl_model();
    let mut model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let cases = cases(&model, &dir);
    let case = &cases[2];
    let seq = [SeqInput {
        tokens: &case.tokens,
        slot: None,
        replay: None,
        images: &case.images,
    }];
    let stages = model.stages(&seq).unwrap();
    assert!(stages.has_images());
    let mut h = stages.embed();
    for l in 0..stages.num_layers() {
        h = stages.layer(l, &h, None).unwrap().0;
    }
    let diff = max_abs_diff(&tch::no_grad(|| stages.head(&h)), &case.logits);
    assert!(diff < 1e-4, "stages vs transformers: {diff:e}");
    drop(stages);

    let units = model.trainable_units();
    let vision = model.vision_unit().unwrap();
    assert_eq!(vision, units.len() - 1);
    assert!(model.tied_head());
    let trainable = model.trainable();
    assert_eq!(units[vision].end, trainable.len());
    let slices = model.named_slices();
    let visual: Vec<_> = slices
        .iter()
        .filter(|s| s.name.starts_with("visual."))
        .collect();
    assert!(visual.iter().all(|s| units[vision].contains(&s.tensor)));
    assert!(visual
        .iter()
        .any(|s| s.name == "visual.patch_embed.proj.weight"));
    let covered: usize = slices
        .iter()
        .map(|s| s.shape.iter().product::<i64>() as usize)
        .sum();
    let owned: usize = trainable.iter().map(|t| t.numel()).sum();
    assert_eq!(covered, owned, "every trainable element is named once");

    for frozen in [true, false] {
        if frozen {
            model.freeze_vision();
        }
        assert_eq!(model.vision_frozen(), frozen);
        let params: Vec<Tensor> = model
            .trainable()
            .into_iter()
            .map(|t| t.set_requires_grad(true))
            .collect();
        for p in &params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let seq = [SeqInput {
            tokens: &case.tokens,
            slot: None,
            replay: None,
            images: &case.images,
        }];
        let logits = model.forward(&seq, None, LogitsFor::All).unwrap().logits;
        logits
            .log_softmax(-1, Kind::Float)
            .mean(Kind::Float)
            .backward();
        let has_grad = |range: std::ops::Range<usize>| {
            params[range].iter().all(|p| {
                p.grad().defined() && p.grad().abs().sum(Kind::Float).double_value(&[]) > 0.0
            })
        };
        assert!(has_grad(0..units[1].end), "the text model trains");
        if frozen {
            assert!(
                params[units[vision].clone()]
                    .iter()
                    .all(|p| !p.grad().defined()),
                "a frozen tower gets no gradient"
            );
            // Reset for the unfrozen pass: a fresh model, so `freeze_vision` is undone.
            model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
        } else {
            assert!(has_grad(units[vision].clone()), "an unfrozen tower trains");
        }
    }
}
