//! Forward consistency (DESIGN §3 invariant 3) on the trainer's side: the log-probabilities the
//! trainer recomputes for sampled tokens, in one packed, differentiable forward, equal the
//! behaviour logprobs the engine reported (dense, and MoE with routing replayed), and gradients
//! reach the weights.

mod common;

use common::{dense_model, engine_options, moe_model, start_engine};
use moult_runtime::engine::npy::decode_routed_experts;
use moult_runtime::model::Qwen3Model;
use moult_runtime::trainer::logprobs::{token_logprobs, Scored};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

/// One engine generation: prompt + output tokens, prompt length, behaviour logprobs, routed
/// experts.
type Sample = (Vec<i64>, usize, Vec<f32>, Option<String>);

/// A few engine generations.
async fn sample(url: &str, temperature: f64) -> Vec<Sample> {
    let mut out = Vec::new();
    for i in 0..3i64 {
        let prompt: Vec<i64> = (0..(5 + 3 * i)).map(|j| (i * 97 + j * 13) % 2000).collect();
        let body = json!({"token_ids": prompt, "sampling_params": {"max_tokens": 12 + 4 * i, "temperature": temperature, "seed": i, "ignore_eos": true}});
        let v: Value = common::post_json(&format!("{url}/inference/v1/generate"), &body).await;
        let c = &v["choices"][0];
        let ids: Vec<i64> = serde_json::from_value(c["token_ids"].clone()).unwrap();
        let lps: Vec<f32> = c["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["logprob"].as_f64().unwrap() as f32)
            .collect();
        let mut tokens = prompt.clone();
        tokens.extend(&ids);
        out.push((
            tokens,
            prompt.len(),
            lps,
            c["routed_experts"].as_str().map(str::to_string),
        ));
    }
    out
}

fn check(model: &Qwen3Model, samples: &[Sample], temperature: f64, replay: bool) {
    let replays: Vec<Option<Tensor>> = samples
        .iter()
        .map(|(tokens, _, _, routed)| {
            replay.then(|| {
                let (shape, ids) = decode_routed_experts(routed.as_deref().unwrap()).unwrap();
                let ids: Vec<i64> = ids.into_iter().map(i64::from).collect();
                let t = Tensor::from_slice(&ids).view([
                    shape[0] as i64,
                    shape[1] as i64,
                    shape[2] as i64,
                ]);
                // The engine reports tokens - 1 rows (the last token was never fed): pad one row.
                let last = t.get(shape[0] as i64 - 1).unsqueeze(0);
                assert_eq!(shape[0], tokens.len() - 1);
                Tensor::cat(&[t, last], 0)
            })
        })
        .collect();
    let seqs: Vec<Scored> = samples
        .iter()
        .zip(&replays)
        .map(|((tokens, _, _, _), r)| Scored {
            tokens,
            replay: r.as_ref(),
        })
        .collect();
    let logp = token_logprobs(model, &seqs, temperature).unwrap();
    for (i, (tokens, p_len, lps, _)) in samples.iter().enumerate() {
        let row: Vec<f32> = Vec::try_from(logp.get(i as i64).detach()).unwrap();
        for (k, want) in lps.iter().enumerate() {
            let got = row[p_len + k];
            assert!(
                (got - want).abs() < 1e-4,
                "sequence {i} token {k}: {got} vs {want}"
            );
        }
        assert!(
            row[tokens.len()..].iter().all(|&v| v == 0.0),
            "padding is 0"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_trainer_logprobs_equal_the_engines_behaviour_logprobs() {
    let dir = dense_model();
    let engine = start_engine(&dir, engine_options()).await;
    let model = Qwen3Model::load(&dir, Kind::Float, Device::Cpu).unwrap();
    for t in [1.0, 0.7] {
        let samples = sample(&engine.url, t).await;
        tch::no_grad(|| check(&model, &samples, t, false));
    }
    // Gradients reach the weights.
    let samples = sample(&engine.url, 1.0).await;
    let params = model.params();
    let w = params.values().next().unwrap();
    let _ = w.shallow_clone().set_requires_grad(true);
    let seqs: Vec<Scored> = samples
        .iter()
        .map(|(t, _, _, _)| Scored {
            tokens: t,
            replay: None,
        })
        .collect();
    token_logprobs(&model, &seqs, 1.0)
        .unwrap()
        .sum(Kind::Float)
        .backward();
    assert!(w.grad().abs().sum(Kind::Float).double_value(&[]) > 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_trainer_replays_moe_routing_to_the_engines_logprobs() {
    let dir = moe_model();
    let engine = start_engine(&dir, engine_options()).await;
    let model = Qwen3Model::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let samples = sample(&engine.url, 1.0).await;
    tch::no_grad(|| check(&model, &samples, 1.0, true));
}
