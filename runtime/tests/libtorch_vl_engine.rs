//! The built-in engine with images (libtorch): `moult engine` serving the tiny Qwen2.5-VL of
//! `tests/python/make_vl_model.py` takes vLLM's `content_parts` beside `token_ids`
//! (docs/vision.md, "Images to the engine").

mod common;

use std::path::Path;
use std::sync::Arc;

use base64::Engine as _;
use moult_runtime::engine::sampling::{processed_logprob, SamplingParams};
use moult_runtime::model::{CausalLm, ImageInput, LogitsFor, SeqInput};
use moult_runtime::vision::{preprocess_bytes, ImageProcessorConfig};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

/// The two-image reference prompt (the processor's ids) and its images' data URLs.
fn two_image_prompt(dir: &Path) -> (Vec<i64>, Vec<String>, Tensor) {
    let tensors: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(dir.join("reference.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let len = tensors["prompt_len_2"].int64_value(&[0]);
    let prompt = Vec::<i64>::try_from(tensors["prompt_2"].narrow(0, 0, len)).unwrap();
    let urls = ["images/a.png", "images/b.png"]
        .iter()
        .map(|f| {
            let bytes = std::fs::read(dir.join(f)).unwrap();
            format!(
                "data:image/png;base64,{}",
                base64::engine::general_purpose::STANDARD.encode(bytes)
            )
        })
        .collect();
    (prompt, urls, tensors["logits_2"].shallow_clone())
}

fn image_parts(urls: &[String]) -> Value {
    urls.iter()
        .map(|u| json!({"type": "image_url", "url": u}))
        .collect()
}

/// `moult engine` on the tiny VL model, prefilling at most 16 prompt tokens a step, so a prompt's
/// images are cut across chunks.
fn spawn_vl_engine(dir: &Path) -> (std::process::Child, String) {
    let args: Vec<&std::ffi::OsStr> = vec![
        "engine".as_ref(),
        "--model".as_ref(),
        dir.as_os_str(),
        "--port".as_ref(),
        "0".as_ref(),
        "--threads".as_ref(),
        "1".as_ref(),
        "--max-prefill-tokens".as_ref(),
        "16".as_ref(),
    ];
    common::spawn_moult(&args, "moult engine listening on")
}

/// The greedy logprob of each output token under our model (shown equal to transformers' in
/// `libtorch_vl_model_parity`), from one full forward over prompt + output with the images.
fn reference_logprobs(
    model: &CausalLm,
    prompt: &[i64],
    urls: &[String],
    output: &[i64],
) -> Vec<f32> {
    let processor = ImageProcessorConfig::from_model_dir(&common::vl_model()).unwrap();
    let images: Vec<Arc<_>> = urls
        .iter()
        .map(|u| {
            let image = moult_runtime::vision::parse_data_url(u).unwrap();
            Arc::new(preprocess_bytes(&image.bytes, &processor).unwrap())
        })
        .collect();
    let images: Vec<ImageInput> = model.place_images(prompt, images).unwrap();
    let mut tokens = prompt.to_vec();
    tokens.extend_from_slice(&output[..output.len() - 1]);
    let seq = [SeqInput {
        tokens: &tokens,
        slot: None,
        replay: None,
        images: &images,
    }];
    let logits = tch::no_grad(|| model.forward(&seq, None, LogitsFor::All))
        .unwrap()
        .logits;
    let greedy = SamplingParams {
        temperature: 0.0,
        ..Default::default()
    };
    output
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let row = Vec::<f32>::try_from(logits.get((prompt.len() - 1 + i) as i64)).unwrap();
            processed_logprob(&row, t, &greedy)
        })
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}");
    let worst = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        worst < 1e-4,
        "{what}: logprobs differ by {worst:e}: {got:?} vs {want:?}"
    );
    worst
}

async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// A greedy generation with two images of different sizes, prefilled in 16-token chunks that
/// cut through them, has the logprobs of a full forward of the model (within 1e-4), whose first
/// token and logprob are transformers' own; a wrong placeholder count, a video, missing images
/// and images sent to a text-only model are each refused with a 400 naming `content_parts`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_engine_generates_from_images_as_transformers_does() {
    let dir = common::vl_model();
    let (mut child, url) = spawn_vl_engine(&dir);
    let generate = format!("{url}/inference/v1/generate");
    let (prompt, urls, hf_logits) = two_image_prompt(&dir);
    let (status, r) = post(
        &generate,
        &json!({"token_ids": prompt, "content_parts": image_parts(&urls),
                "sampling_params": {"temperature": 0.0, "max_tokens": 6, "logprobs": 0, "ignore_eos": true}}),
    )
    .await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    let output: Vec<i64> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
    let logprobs: Vec<f32> = choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["logprob"].as_f64().unwrap() as f32)
        .collect();
    assert_eq!(output.len(), 6);

    // The first token against transformers' logits directly.
    let last = hf_logits.get(prompt.len() as i64 - 1);
    assert_eq!(output[0], last.argmax(0, false).int64_value(&[]));
    let hf_first = last.log_softmax(0, Kind::Float).double_value(&[output[0]]) as f32;
    let first = assert_close(&logprobs[..1], &[hf_first], "first token vs transformers");

    let model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let want = reference_logprobs(&model, &prompt, &urls, &output);
    let worst = assert_close(&logprobs, &want, "engine vs full forward");
    println!("engine with 2 images: first logprob vs transformers {first:.2e}, all vs full forward {worst:.2e}");

    // Refusals, each naming the field.
    let refusals = [
        (json!(image_parts(&urls[..1])), "content_parts"),
        (json!(null), "content_parts"),
        (
            json!([{"type": "image_url", "url": urls[0]}, {"type": "video_url", "url": urls[1]}]),
            "content_parts[1].type",
        ),
        (
            json!([{"type": "image_url", "url": urls[0]}, {"type": "image_url", "url": "https://example.com/b.png"}]),
            "content_parts[1].url",
        ),
    ];
    for (parts, param) in refusals {
        let (status, r) = post(
            &generate,
            &json!({"token_ids": prompt, "content_parts": parts, "sampling_params": {"max_tokens": 1}}),
        )
        .await;
        assert_eq!(status, 400, "{parts}: {r}");
        assert_eq!(r["error"]["param"], param, "{r}");
    }
    let (status, r) = post(
        &generate,
        &json!({"token_ids": prompt, "content_parts": image_parts(&urls[1..]), "sampling_params": {"max_tokens": 1}}),
    )
    .await;
    assert_eq!(status, 400);
    let message = r["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("[24, 15]") && message.contains("[15]"),
        "{message}"
    );
    child.kill().unwrap();

    let text = common::start_engine(&common::dense_model(), common::engine_options()).await;
    let (status, r) = post(
        &format!("{}/inference/v1/generate", text.url),
        &json!({"token_ids": [1, 2, 3], "content_parts": image_parts(&urls[..1]), "sampling_params": {"max_tokens": 1}}),
    )
    .await;
    assert_eq!(status, 400, "{r}");
    assert_eq!(r["error"]["param"], "content_parts");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("text-only"),
        "{r}"
    );
}

/// A request with images paused (keep) in the middle of its generation, its cache dropped by a
/// weight reload and recomputed after resume, still sees its images: every logprob is the full
/// forward's with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_engine_keeps_a_requests_images_through_pause_and_recompute() {
    let dir = common::vl_model();
    let (mut child, url) = spawn_vl_engine(&dir);
    let (prompt, urls, _) = two_image_prompt(&dir);
    let max_tokens = 120;
    let response = reqwest::Client::new()
        .post(format!("{url}/inference/v1/generate"))
        .json(&json!({"token_ids": prompt, "content_parts": image_parts(&urls), "stream": true,
                      "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": true}}))
        .send()
        .await
        .unwrap();
    let (tx, mut progress) = tokio::sync::watch::channel(0usize);
    let reader = tokio::spawn(common::Generation::read(response, move |g| {
        let _ = tx.send(g.ids.len());
    }));
    progress.wait_for(|&n| n >= 3).await.unwrap();
    let (status, _) = post(&format!("{url}/pause?mode=keep"), &json!({})).await;
    assert_eq!(status, 200);
    let at_pause = *progress.borrow();
    assert!(at_pause < max_tokens, "paused before the request finished");
    // A reload from a folder of the same weights clears every running sequence's cache.
    let weights =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("vl-weights-{}", std::process::id()));
    std::fs::create_dir_all(&weights).unwrap();
    std::fs::copy(
        dir.join("model.safetensors"),
        weights.join("model.safetensors"),
    )
    .unwrap();
    let (status, r) = post(
        &format!("{url}/collective_rpc"),
        &json!({"method": "reload_weights", "kwargs": {"weights_path": weights}}),
    )
    .await;
    std::fs::remove_dir_all(&weights).unwrap();
    assert_eq!(status, 200, "{r}");
    let (status, _) = post(&format!("{url}/resume"), &json!({})).await;
    assert_eq!(status, 200);
    let generation = reader.await.unwrap();
    assert_eq!(generation.ids.len(), max_tokens);
    let model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let want = reference_logprobs(&model, &prompt, &urls, &generation.ids);
    let worst = assert_close(&generation.logprobs, &want, "after pause and recompute");
    println!(
        "paused after {at_pause} of {max_tokens} tokens, recomputed; worst logprob gap {worst:.2e}"
    );
    child.kill().unwrap();
}
