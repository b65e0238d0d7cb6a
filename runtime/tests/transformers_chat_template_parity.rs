//! Chat-template rendering matches transformers' `apply_chat_template` renderer byte for byte,
//! for every real template in `tests/fixtures` over conversations with system prompts,
//! multi-turn history, tools and tool calls, reasoning, and non-ASCII text (needs the Python
//! virtualenv with transformers).

mod common;

use std::path::Path;
use std::process::Command;

use moult_runtime::chat::{ChatTemplate, RenderOptions};
use serde_json::{json, Map, Value};

fn cases() -> Value {
    let weather = json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "City name"}, "celsius": {"type": "boolean"}},
                "required": ["city"]
            }
        }
    });
    let special = json!({"bos_token": "<BOS>", "eos_token": "<EOS>"});
    let with = |extra: Value| {
        let mut k = special.as_object().unwrap().clone();
        k.extend(extra.as_object().unwrap().clone());
        Value::Object(k)
    };
    json!([
        {"name": "system_user", "add_generation_prompt": true, "kwargs": special,
         "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]},
        {"name": "multi_turn", "add_generation_prompt": true, "kwargs": special,
         "messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "One"},
                      {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}]},
        {"name": "no_generation_prompt", "add_generation_prompt": false, "kwargs": special,
         "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
        {"name": "tools", "add_generation_prompt": true, "kwargs": special, "tools": [weather],
         "messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "", "tool_calls": [{"id": "call12345", "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Paris", "celsius": true}}}]},
                      {"role": "tool", "name": "get_weather", "tool_call_id": "call12345", "content": "{\"temp\": 21.5}"},
                      {"role": "user", "content": "Thanks"}]},
        // Tools offered on a first turn (Gemma 3's template ignores them).
        {"name": "tools_offered", "add_generation_prompt": true, "kwargs": special, "tools": [weather],
         "messages": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"}]},
        {"name": "reasoning", "add_generation_prompt": true, "kwargs": with(json!({"enable_thinking": false})),
         "messages": [{"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
                      {"role": "user", "content": "And 3+3?"}]},
        {"name": "unicode", "add_generation_prompt": true, "kwargs": special,
         "messages": [{"role": "user", "content": "héllo 世界 <tag> & \"quotes\"\n\ttabs"}]},
        // Content as a list of parts (Gemma 3 reads a system prompt's first part and marks
        // images), and two user turns in a row (templates that require alternation raise).
        {"name": "content_parts", "add_generation_prompt": true, "kwargs": special,
         "messages": [{"role": "system", "content": [{"type": "text", "text": "Be brief. "}]},
                      {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " What is this?\n"}]}]},
        {"name": "consecutive_users", "add_generation_prompt": true, "kwargs": special,
         "messages": [{"role": "user", "content": "First."}, {"role": "user", "content": "Second."}]}
    ])
}

const TEMPLATES: [&str; 9] = [
    "qwen3_chat_template.jinja",
    "qwen3_chat_template_llamacpp_2025-05.jinja",
    "qwen3_coder_chat_template.jinja",
    "qwen2.5_7b_instruct_chat_template.jinja",
    "llama3.1_8b_instruct_chat_template.jinja",
    "llama3.2_3b_instruct_chat_template.jinja",
    "mistral_nemo_instruct_2407_chat_template.jinja",
    "deepseek_v3.1_chat_template.jinja",
    "gemma3_it_chat_template.jinja",
];

fn fixtures() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

#[test]
fn transformers_chat_templates_render_identically() {
    let cases = cases();
    let templates: Map<String, Value> = TEMPLATES
        .iter()
        .map(|t| (t.to_string(), json!(fixtures().join(t).to_str().unwrap())))
        .collect();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("chat-templates-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let spec = dir.join("cases.json");
    let out = dir.join("reference.json");
    std::fs::write(
        &spec,
        json!({"templates": templates, "cases": cases}).to_string(),
    )
    .unwrap();
    let status = Command::new(common::python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/render_chat_templates.py"))
        .arg(&spec)
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();

    let mut failures = Vec::new();
    let mut compared = 0;
    for name in TEMPLATES {
        let source = std::fs::read_to_string(fixtures().join(name)).unwrap();
        let template =
            ChatTemplate::new(&source, Map::new()).unwrap_or_else(|e| panic!("{name}: {e}"));
        for case in cases.as_array().unwrap() {
            let case_name = case["name"].as_str().unwrap();
            let opts = RenderOptions {
                tools: case.get("tools").cloned(),
                documents: None,
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                extra: case["kwargs"].as_object().unwrap().clone(),
            };
            let ours = template.render(&case["messages"], &opts);
            let theirs = &reference[name][case_name];
            match (ours, theirs.get("text")) {
                (Ok(text), Some(expected)) => {
                    compared += 1;
                    if text != expected.as_str().unwrap() {
                        failures.push(format!(
                            "{name} / {case_name}:\n--- transformers\n{}\n--- ours\n{text}",
                            expected.as_str().unwrap()
                        ));
                    }
                }
                // The template raised: we must fail too, and where it raised on purpose
                // (raise_exception), with its message.
                (Err(e), None) => match theirs["raised"].as_str() {
                    Some(message) if !e.to_string().contains(message) => failures.push(format!(
                        "{name} / {case_name}: transformers raised {message:?} but we failed with: {e}"
                    )),
                    _ => compared += 1,
                },
                (Ok(text), None) => failures.push(format!(
                    "{name} / {case_name}: transformers failed ({}) but we rendered:\n{text}",
                    theirs["error"]
                )),
                (Err(e), Some(_)) => failures.push(format!(
                    "{name} / {case_name}: transformers rendered but we failed: {e}"
                )),
            }
        }
    }
    // A model folder: the template from tokenizer_config.json, or chat_template.jinja beside it.
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::copy(
        fixtures().join("qwen3_tokenizer_config.json"),
        model.join("tokenizer_config.json"),
    )
    .unwrap();
    let first = &cases.as_array().unwrap()[0];
    let opts = RenderOptions {
        add_generation_prompt: true,
        ..Default::default()
    };
    let from_config = ChatTemplate::from_model_dir(&model)
        .unwrap()
        .render(&first["messages"], &opts)
        .unwrap();
    assert_eq!(
        from_config,
        reference["qwen3_chat_template.jinja"]["system_user"]["text"]
            .as_str()
            .unwrap()
    );
    std::fs::copy(
        fixtures().join("qwen2.5_7b_instruct_chat_template.jinja"),
        model.join("chat_template.jinja"),
    )
    .unwrap();
    let from_file = ChatTemplate::from_model_dir(&model)
        .unwrap()
        .render(&first["messages"], &opts)
        .unwrap();
    assert_eq!(
        from_file,
        reference["qwen2.5_7b_instruct_chat_template.jinja"]["system_user"]["text"]
            .as_str()
            .unwrap()
    );

    assert!(
        failures.is_empty(),
        "{} of {} renders differ:\n\n{}",
        failures.len(),
        compared + failures.len(),
        failures.join("\n\n")
    );
    assert_eq!(compared, TEMPLATES.len() * cases.as_array().unwrap().len());
}
