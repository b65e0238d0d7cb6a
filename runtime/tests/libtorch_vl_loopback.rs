//! Images through the loopback server (docs/vision.md): the real `openai` and `anthropic` SDKs
//! (tests/python/vl_sdk_client.py) send images to a tiny Qwen2.5-VL served by the built-in
//! engine, over two turns. The recorded segment holds each image's placeholders (as many as its
//! patches make, between the vision start and end tokens) and the image itself, and the trainer,
//! recomputing the segment with those images, gets the engine's logprobs.

mod common;

use std::sync::Arc;

use image::ImageEncoder as _;
use moult_runtime::chat::{ChatTemplate, Image, Tokenizer};
use moult_runtime::loopback::{ChatService, EngineClient, ImageInputs, ServiceOptions};
use moult_runtime::model::SeqInput;
use moult_runtime::model::{CausalLm, ImageInput};
use moult_runtime::trainer::logprobs::token_logprobs;
use moult_runtime::vision::{image_placeholder_tokens, preprocess_bytes};
use tch::{Device, Kind};

const VISION_START: i64 = 151652;
const VISION_END: i64 = 151653;
const IMAGE_PAD: i64 = 151655;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_sdks_send_images_and_the_trainer_recomputes_the_engine_logprobs() {
    let model = common::vl_model();
    // The tiny model's folder has Qwen3's template, which renders no images: Qwen2-VL's does.
    let template = std::env::temp_dir().join(format!("moult-vl-template-{}", std::process::id()));
    std::fs::create_dir_all(&template).unwrap();
    std::fs::copy(
        common::repo_root().join("tests/fixtures/qwen2_vl_chat_template.jinja"),
        template.join("chat_template.jinja"),
    )
    .unwrap();
    let (mut engine, engine_url) = common::spawn_engine(&model);
    // As in a run: the loopback server generates through a router in front of the engine.
    let (router_url, _router) =
        common::start_router(std::slice::from_ref(&engine_url), "least-tokens").await;
    let tokenizer = Tokenizer::from_model_dir(&model).unwrap();
    let images = ImageInputs::from_model_dir(&model, &tokenizer)
        .unwrap()
        .expect("a vision-language model");
    let opts = ServiceOptions {
        registered_sessions: false,
        ..ServiceOptions::pool(8, "tiny")
    };
    let service = ChatService::new(
        EngineClient::new(&router_url),
        tokenizer,
        ChatTemplate::from_model_dir(&template).unwrap(),
        opts,
    )
    .with_images(Some(images));
    let (url, service) = common::serve_loopback(service, 16 << 20).await;

    let (a, b) = (model.join("images/a.png"), model.join("images/b.png"));
    let script = common::repo_root().join("tests/python/vl_sdk_client.py");
    let output = {
        let (a, b) = (a.clone(), b.clone());
        tokio::task::spawn_blocking(move || {
            std::process::Command::new(common::python())
                .arg(script)
                .arg(&url)
                .args([&a, &b])
                .output()
                .unwrap()
        })
        .await
        .unwrap()
    };
    assert!(
        output.status.success(),
        "the SDK client failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );

    let policy = CausalLm::load(&model, Kind::Float, Device::Cpu).unwrap();
    let config = policy.image_processor().unwrap().clone();
    let hash =
        |p: &std::path::Path| Image::from_bytes("image/png", &std::fs::read(p).unwrap()).sha256;
    for (session, order) in [("openai-vl", [&a, &b]), ("anthropic-vl", [&b, &a])] {
        let (turns, segments) = service.trajectory(session).await.unwrap();
        assert_eq!(turns, 2, "{session}");
        assert_eq!(
            segments.len(),
            1,
            "{session}: the second turn continues the first"
        );
        let seg = &segments[0];
        assert_eq!(seg.images.len(), 2, "{session}");
        let mut processed = Vec::new();
        for (image, path) in seg.images.iter().zip(order) {
            assert_eq!(image.image.sha256, hash(path), "{session}: images in order");
            let pixels = preprocess_bytes(&image.image.bytes().unwrap(), &config).unwrap();
            assert_eq!(
                image.tokens,
                image_placeholder_tokens(pixels.grid_thw, config.merge_size),
                "{session}: placeholders per image"
            );
            let span = &seg.token_ids[image.offset..image.offset + image.tokens];
            assert!(span.iter().all(|&t| t == IMAGE_PAD), "{session}");
            assert_eq!(seg.token_ids[image.offset - 1], VISION_START);
            assert_eq!(seg.token_ids[image.offset + image.tokens], VISION_END);
            assert!(seg.loss_mask[image.offset..image.offset + image.tokens]
                .iter()
                .all(|&m| m == 0));
            processed.push(ImageInput {
                offset: image.offset,
                image: Arc::new(pixels),
            });
        }
        // Every image pad of the segment belongs to an image.
        let pads = seg.token_ids.iter().filter(|&&t| t == IMAGE_PAD).count();
        assert_eq!(pads, seg.images.iter().map(|i| i.tokens).sum::<usize>());

        let seqs = [SeqInput {
            slot: None,
            tokens: &seg.token_ids,
            replay: None,
            images: &processed,
        }];
        let recomputed: Vec<f32> = Vec::try_from(
            tch::no_grad(|| token_logprobs(&policy, &seqs, 1.0))
                .unwrap()
                .get(0),
        )
        .unwrap();
        let mut worst = 0f32;
        for (t, &m) in seg.loss_mask.iter().enumerate() {
            if m == 1 {
                worst = worst.max((recomputed[t] - seg.logprobs[t]).abs());
            }
        }
        println!(
            "{session}: {} tokens, images of {:?} placeholders, {} sampled; trainer vs engine logprobs {worst:.2e}",
            seg.token_ids.len(),
            seg.images.iter().map(|i| i.tokens).collect::<Vec<_>>(),
            seg.sampled_tokens()
        );
        assert!(seg.sampled_tokens() >= 2);
        assert!(
            worst < 1e-4,
            "{session}: trainer and engine differ by {worst}"
        );
    }

    // A large image (a 5 MiB request, over axum's 2 MiB default) goes through the router too.
    let noise: Vec<u8> = (0..1100u32 * 1000 * 3)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(&noise, 1100, 1000, image::ExtendedColorType::Rgb8)
        .unwrap();
    let url = Image::from_bytes("image/png", &png).data_url;
    assert!(url.len() > 4 << 20, "{} bytes", url.len());
    let body = serde_json::json!({"token_ids": [VISION_START, IMAGE_PAD, VISION_END, 3838],
        "content_parts": [{"type": "image_url", "url": url}],
        "sampling_params": {"max_tokens": 1, "temperature": 0.0}});
    let answer = common::post_json(&format!("{router_url}/inference/v1/generate"), &body).await;
    let generated = answer["choices"][0]["token_ids"].as_array().map(Vec::len);
    assert_eq!(
        generated,
        Some(1),
        "the large image was not served: {answer}"
    );
    println!(
        "a {} MiB request through the router was served",
        url.len() >> 20
    );
    engine.kill().unwrap();
    engine.wait().unwrap();
    let _ = std::fs::remove_dir_all(&template);
}
