//! Our tokenizer (the `tokenizers` crate on `tokenizer.json`) encodes like transformers' Qwen3
//! tokenizer, rendered chat templates with their special tokens included, and decodes back to
//! the same text (needs the Python virtualenv with transformers).

mod common;

use std::path::Path;
use std::process::Command;

use moult_runtime::chat::{ChatTemplate, RenderOptions, Tokenizer};
use serde_json::json;

#[test]
fn transformers_qwen3_tokenizer_encodes_identically() {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("qwen3-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("model");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    let template = ChatTemplate::from_model_dir(&dir).unwrap();
    let conversation = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's 17 × 23? Answer in 日本語, please.\n\nThanks!"},
        {"role": "assistant", "content": "391です。", "reasoning_content": "17*23 = 391"},
        {"role": "user", "content": "  leading spaces, tabs\tand émojis 🎉 <tag>"}
    ]);
    let rendered = template
        .render(
            &conversation,
            &RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
        .unwrap();
    let texts = vec![
        rendered,
        "Hello world".to_string(),
        "   multiple   spaces\n\n\nnewlines\r\n".to_string(),
        "numbers 1234567 3.14159 -42".to_string(),
        "<|im_start|>user\nraw special tokens<|im_end|><|endoftext|>".to_string(),
        "code: fn main() { println!(\"{}\", x); }".to_string(),
    ];
    let texts_path = dir.join("texts.json");
    let out = dir.join("ids.json");
    std::fs::write(&texts_path, serde_json::to_string(&texts).unwrap()).unwrap();
    let status = Command::new(common::python())
        .arg(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../tests/python/encode_with_qwen3_tokenizer.py"),
        )
        .arg(&model)
        .arg(&texts_path)
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let expected: Vec<Vec<i64>> =
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();

    let tokenizer = Tokenizer::from_model_dir(&model).unwrap();
    assert_eq!(tokenizer.vocab_size(), 151_669);
    for (text, ids) in texts.iter().zip(&expected) {
        assert_eq!(&tokenizer.encode(text).unwrap(), ids, "encoding {text:?}");
        assert_eq!(
            &tokenizer.decode(ids, false).unwrap(),
            text,
            "round trip of {text:?}"
        );
    }
    // The chat-template special tokens are single ids.
    assert_eq!(
        tokenizer.encode("<|im_start|><|im_end|>").unwrap(),
        vec![151_644, 151_645]
    );
    let err = Tokenizer::from_model_dir(&dir.join("nowhere"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("tokenizer.json"), "{err}");
}
