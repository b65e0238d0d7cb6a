//! What clients send the servers: chat requests in OpenAI's and Anthropic's protocols (from
//! agent code), their rendering through real chat templates, the model's output split into tool
//! calls, the engine API's `generate` body, and the engine's streamed answers (from a vLLM pod).

use std::collections::VecDeque;

use moult_runtime::chat::{
    ChatRequest, ChatTemplate, Hermes, Llama3Json, MistralTools, NoTools, Pythonic, RenderOptions,
    ToolCallParser,
};
use moult_runtime::engine::api::GenerateRequest;
use moult_runtime::engine::client::SseDecoder;
use moult_runtime::loopback::anthropic::MessagesRequest;
use moult_runtime::loopback::openai::CompletionRequest;
use serde_json::{Map, Value as Json};

/// The chat templates of `tests/fixtures/` that the targets render with.
const TEMPLATES: [&str; 6] = [
    "qwen3_chat_template.jinja",
    "llama3.1_8b_instruct_chat_template.jinja",
    "mistral_nemo_instruct_2407_chat_template.jinja",
    "gemma3_it_chat_template.jinja",
    "deepseek_v3.1_chat_template.jinja",
    "qwen2_vl_chat_template.jinja",
];

thread_local! {
    static PARSED: Vec<ChatTemplate> = {
        let special: Map<String, Json> = [("bos_token", "<s>"), ("eos_token", "</s>")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), Json::from(v)))
            .collect();
        TEMPLATES
            .iter()
            .map(|t| ChatTemplate::new(&crate::fixture(t), special.clone()).expect("a fixture"))
            .collect()
    };
}

/// Renders with the template `pick` selects: an error or a prompt, never a panic.
fn render(pick: u8, request: &ChatRequest) {
    PARSED.with(|t| {
        let _ = request.render(&t[pick as usize % t.len()]);
    })
}

/// Messages (and tools) as JSON, rendered by each chat template of the fixtures: the first byte
/// picks the template. A template may refuse a conversation, never panic.
pub fn chat_template(data: &[u8]) {
    let Some((&pick, body)) = data.split_first() else {
        return;
    };
    let Ok(body) = serde_json::from_slice::<Json>(body) else {
        return;
    };
    let opts = RenderOptions {
        tools: body.get("tools").cloned(),
        documents: body.get("documents").cloned(),
        add_generation_prompt: pick & 0x80 == 0,
        extra: body
            .get("extra")
            .and_then(Json::as_object)
            .cloned()
            .unwrap_or_default(),
    };
    let messages = body.get("messages").cloned().unwrap_or(body);
    PARSED.with(|t| {
        let _ = t[pick as usize % t.len()].render(&messages, &opts);
    })
}

/// A model's output, split into content and tool calls by every family's parser: calls carry
/// a name and an arguments object, the content is what comes before them, and what a growing
/// output streams as certain content is never taken back.
pub fn tool_calls(data: &[u8]) {
    let Some(text) = crate::text(data) else {
        return;
    };
    let parsers: [&dyn ToolCallParser; 5] =
        [&Hermes, &Llama3Json, &MistralTools, &Pythonic, &NoTools];
    for parser in parsers {
        let parsed = parser.parse(text);
        for call in &parsed.tool_calls {
            assert!(
                call.arguments.is_object(),
                "{parser:?}: {:?}",
                call.arguments
            );
        }
        let content = parsed.content.as_deref().unwrap_or("");
        if parsed.tool_calls.is_empty() {
            assert_eq!(
                content, text,
                "{parser:?}: no calls, so all of it is content"
            );
        }
        for cut in (0..=text.len()).filter(|&c| text.is_char_boundary(c)) {
            let n = parser.content_prefix_len(&text[..cut]);
            assert!(
                n <= cut && text.is_char_boundary(n),
                "{parser:?}: {n} of {cut}"
            );
            let streamed = text[..n].trim_end();
            assert!(
                content.starts_with(streamed) || parsed.tool_calls.is_empty(),
                "{parser:?}: streamed {streamed:?} as content, but the content is {content:?}"
            );
        }
    }
}

/// A chat completions body: refused with a message, or a request every template renders or
/// refuses.
pub fn openai(data: &[u8]) {
    let Ok(body) = serde_json::from_slice::<CompletionRequest>(data) else {
        return;
    };
    if let Ok(request) = body.into_chat() {
        render(data.len() as u8, &request);
    }
}

/// An Anthropic messages body, the same way.
pub fn anthropic(data: &[u8]) {
    let Ok(body) = serde_json::from_slice::<MessagesRequest>(data) else {
        return;
    };
    if let Ok(request) = body.into_chat() {
        render(data.len() as u8, &request);
    }
}

/// The engine API's `generate` body (from the router, or from anyone holding the agent
/// credential): refused naming the field, or a prompt inside the vocabulary whose generation fits
/// the model's length.
pub fn generate(data: &[u8]) {
    const VOCAB: usize = 2003;
    const MAX_MODEL_LEN: usize = 64;
    let Ok(body) = serde_json::from_slice::<GenerateRequest>(data) else {
        return;
    };
    if let Ok(valid) = body.validate(VOCAB, MAX_MODEL_LEN) {
        assert!(!valid.prompt.is_empty());
        assert!(valid.prompt.iter().all(|&t| (0..VOCAB as i64).contains(&t)));
        assert!(valid.prompt.len() + valid.params.max_tokens <= MAX_MODEL_LEN);
        assert!(valid.routed_experts_prompt_start <= valid.prompt.len());
    }
}

/// The events of `pieces` fed in order, as comparable text.
fn events(pieces: &[&[u8]]) -> Vec<String> {
    let mut decoder = SseDecoder::default();
    let mut out = VecDeque::new();
    for p in pieces {
        decoder.feed(p, &mut out);
    }
    out.into_iter().map(|e| format!("{e:?}")).collect()
}

/// An engine's streamed answer (a vLLM pod's, untrusted on a shared network), however the
/// network cuts it: the first byte says where, and every cut gives the same events.
pub fn sse(data: &[u8]) {
    let Some((&cut, body)) = data.split_first() else {
        return;
    };
    let whole = events(&[body]);
    let at = cut as usize % (body.len() + 1);
    assert_eq!(events(&[&body[..at], &body[at..]]), whole);
    let bytewise: Vec<&[u8]> = body.chunks(1).collect();
    assert_eq!(events(&bytewise), whole);
}
