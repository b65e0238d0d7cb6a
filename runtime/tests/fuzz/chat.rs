//! OpenAI and Anthropic requests through the protocol adapters, the real chat templates of
//! `tests/fixtures` and the session's segment accounting, with a stand-in for the engine that
//! samples random ids. A conversation of several turns (the agent sends back what it got, with
//! edits, compactions and several samples per turn) always leaves segments whose fields have one
//! entry per token, whose loss mask is 1 exactly on the sampled ids (each sample's whole and in
//! order, with its logprobs and version), where each sample follows exactly the prompt the engine
//! was given, and which the episode validator accepts.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use proptest::prelude::*;
use serde_json::{json, Map, Value as Json};

use crate::fuzz::streaming::tiny_tokenizer;
use crate::{drive, Budget, Row};
use moult_runtime::agents::{Episode, EpisodeStatus};
use moult_runtime::chat::{ChatRequest, ChatTemplate};
use moult_runtime::loopback::anthropic::MessagesRequest;
use moult_runtime::loopback::openai::CompletionRequest;
use moult_runtime::loopback::session::{Sampled, Session};
use moult_runtime::rollout::validate::{check as validate, EpisodeLimits};

const TEMPLATES: [&str; 7] = [
    "qwen3_chat_template.jinja",
    "qwen3_chat_template_llamacpp_2025-05.jinja",
    "qwen2.5_7b_instruct_chat_template.jinja",
    "llama3.1_8b_instruct_chat_template.jinja",
    "mistral_nemo_instruct_2407_chat_template.jinja",
    "deepseek_v3.1_chat_template.jinja",
    "gemma3_it_chat_template.jinja",
];

fn templates() -> &'static Vec<ChatTemplate> {
    static T: OnceLock<Vec<ChatTemplate>> = OnceLock::new();
    T.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let special: Map<String, Json> = [
            ("bos_token", "<|begin_of_text|>"),
            ("eos_token", "<|im_end|>"),
            ("pad_token", "<|endoftext|>"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), json!(v)))
        .collect();
        TEMPLATES
            .iter()
            .map(|f| {
                let source = std::fs::read_to_string(dir.join(f)).unwrap();
                ChatTemplate::new(&source, special.clone()).unwrap()
            })
            .collect()
    })
}

/// Text with the tokens and tags templates and parsers care about.
fn text() -> impl Strategy<Value = String> {
    let atom = prop::sample::select(vec![
        "hi",
        " ",
        "\n",
        "Paris",
        "日本語",
        "🎉",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "{\"a\": 1}",
        "{{ x }}",
        "{%",
        "\\",
        "\"",
    ]);
    prop_oneof![
        4 => prop::collection::vec(atom, 0..6).prop_map(|v| v.concat()),
        1 => ".{0,20}",
    ]
}

/// What the agent adds to the conversation before a turn.
#[derive(Debug, Clone)]
enum Add {
    User(String),
    UserParts(Vec<String>),
    System(String),
    ToolResult(String),
    Garbage(Json),
}

fn add() -> impl Strategy<Value = Add> {
    prop_oneof![
        6 => text().prop_map(Add::User),
        1 => prop::collection::vec(text(), 0..3).prop_map(Add::UserParts),
        1 => text().prop_map(Add::System),
        2 => text().prop_map(Add::ToolResult),
        1 => crate::fuzz::generate::value().prop_map(Add::Garbage),
    ]
}

/// How the agent treats its history before the next turn.
#[derive(Debug, Clone)]
enum History {
    /// Sends back the reply it got (the usual case: the turn continues the segment).
    Keep,
    /// Sends back a reply it edited.
    Edit(String),
    /// Drops the oldest messages (compaction).
    Compact(usize),
    /// Sends back the raw text with its special tokens.
    Raw,
}

#[derive(Debug, Clone)]
struct Turn {
    add: Add,
    history: History,
    /// Which sample the agent keeps.
    keep: prop::sample::Index,
    /// Per sample: ids (random, so any byte and special token) and logprobs.
    samples: Vec<Vec<(i64, f32)>>,
    tools: bool,
    stop: Option<String>,
    thinking: Option<bool>,
}

fn turn() -> impl Strategy<Value = Turn> {
    let sample = prop::collection::vec(
        (
            prop_oneof![10 => 0i64..2003, 1 => Just(2002i64)],
            -30.0f32..=0.0,
        ),
        0..8,
    );
    (
        add(),
        prop_oneof![
            6 => Just(History::Keep),
            1 => text().prop_map(History::Edit),
            1 => (1usize..4).prop_map(History::Compact),
            1 => Just(History::Raw),
        ],
        any::<prop::sample::Index>(),
        prop::collection::vec(sample, 1..4),
        any::<bool>(),
        prop::option::of(text()),
        prop::option::of(any::<bool>()),
    )
        .prop_map(
            |(add, history, keep, samples, tools, stop, thinking)| Turn {
                add,
                history,
                keep,
                samples,
                tools,
                stop,
                thinking,
            },
        )
}

#[derive(Debug, Clone)]
struct Case {
    template: usize,
    anthropic: bool,
    turns: Vec<Turn>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        0..TEMPLATES.len(),
        any::<bool>(),
        prop::collection::vec(turn(), 1..5),
    )
        .prop_map(|(template, anthropic, turns)| Case {
            template,
            anthropic,
            turns,
        })
}

fn add_message(messages: &mut Vec<Json>, add: &Add, anthropic: bool) {
    let m = match (add, anthropic) {
        (Add::User(t), _) => json!({"role": "user", "content": t}),
        (Add::UserParts(p), _) => json!({"role": "user",
            "content": p.iter().map(|t| json!({"type": "text", "text": t})).collect::<Vec<_>>()}),
        (Add::System(t), false) => json!({"role": "system", "content": t}),
        (Add::System(t), true) => json!({"role": "user", "content": t}),
        (Add::ToolResult(t), false) => {
            json!({"role": "tool", "tool_call_id": "call_1", "content": t})
        }
        (Add::ToolResult(t), true) => json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": t}]}),
        (Add::Garbage(v), _) => v.clone(),
    };
    messages.push(m);
}

fn reply(text: &str, anthropic: bool) -> Json {
    if anthropic {
        json!({"role": "assistant", "content": [{"type": "text", "text": text}]})
    } else {
        json!({"role": "assistant", "content": text})
    }
}

fn request(messages: &[Json], turn: &Turn, anthropic: bool) -> Result<ChatRequest, String> {
    let tools = turn.tools.then(|| {
        if anthropic {
            json!([{"name": "get_weather", "description": "weather",
                    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}])
        } else {
            json!([{"type": "function", "function": {"name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
        }
    });
    let n = turn.samples.len();
    let body = if anthropic {
        let mut b = json!({"model": "m", "max_tokens": 16, "messages": messages});
        if let Some(t) = tools {
            b["tools"] = t;
        }
        if let Some(s) = &turn.stop {
            b["stop_sequences"] = json!([s]);
        }
        if let Some(on) = turn.thinking {
            b["thinking"] = json!({"type": if on { "enabled" } else { "disabled" }});
        }
        b
    } else {
        let mut b = json!({"model": "m", "messages": messages, "n": n, "logprobs": true});
        if let Some(t) = tools {
            b["tools"] = t;
        }
        if let Some(s) = &turn.stop {
            b["stop"] = json!(s);
        }
        if let Some(on) = turn.thinking {
            b["chat_template_kwargs"] = json!({"enable_thinking": on});
        }
        b
    };
    let text = body.to_string();
    if anthropic {
        serde_json::from_str::<MessagesRequest>(&text)
            .map_err(|e| e.to_string())?
            .into_chat()
            .map_err(|e| e.message)
    } else {
        serde_json::from_str::<CompletionRequest>(&text)
            .map_err(|e| e.to_string())?
            .into_chat()
            .map_err(|e| e.message)
    }
}

fn run(case: Case) -> Result<(), TestCaseError> {
    let tok = tiny_tokenizer();
    let template = &templates()[case.template];
    let mut session = Session::default();
    let mut messages: Vec<Json> = Vec::new();
    // Each sample is tagged by its version: (ids, logprobs) by tag.
    let mut samples_by_tag: HashMap<u64, Vec<(i64, f32)>> = HashMap::new();
    let mut tag = 0u64;
    for turn in &case.turns {
        add_message(&mut messages, &turn.add, case.anthropic);
        let req = match request(&messages, turn, case.anthropic) {
            Ok(r) => r,
            Err(_) => {
                messages.pop();
                continue;
            }
        };
        let rendered = match req.render(template) {
            Ok(r) => r,
            Err(_) => {
                messages.pop();
                continue;
            }
        };
        let plan = session
            .plan(&req.messages, rendered, |t, _| {
                tok.encode(t).map(|ids| (ids, Vec::new()))
            })
            .map_err(|e| TestCaseError::fail(format!("tokenizing a rendering: {e}")))?;
        prop_assert!(plan.prompt.ends_with(&plan.new_ids));
        prop_assert!(plan.prompt.is_empty() || plan.routed_experts_start() < plan.prompt.len());
        let prompt = plan.prompt.clone();
        let n = req.n.min(turn.samples.len());
        let mut sampled = Vec::new();
        let mut texts = Vec::new();
        let mut tags = Vec::new();
        for s in &turn.samples[..n] {
            tag += 1;
            samples_by_tag.insert(tag, s.clone());
            tags.push(tag);
            sampled.push(Sampled {
                token_ids: s.iter().map(|t| t.0).collect(),
                logprobs: s.iter().map(|t| t.1).collect(),
                versions: vec![tag; s.len()],
                routed_experts: None,
            });
            texts.push(
                tok.decode(&sampled.last().unwrap().token_ids, false)
                    .unwrap(),
            );
        }
        session.commit(
            plan,
            Arc::new(req.messages.clone()),
            &sampled,
            texts.clone(),
        );
        let segments = session.segments();
        // Every sample of this turn: exactly the prompt followed by its ids, in one segment.
        for s in &sampled {
            let mut want = prompt.clone();
            want.extend(&s.token_ids);
            prop_assert!(
                segments.iter().any(|g| g.token_ids == want),
                "no segment holds the prompt and the sampled ids"
            );
        }
        for g in &segments {
            let len = g.token_ids.len();
            prop_assert_eq!(g.loss_mask.len(), len);
            prop_assert_eq!(g.logprobs.len(), len);
            prop_assert_eq!(g.versions.len(), len);
            // Mask 1 exactly on sampled ids: runs of whole samples, by their tags.
            let mut i = 0;
            while i < len {
                match (g.loss_mask[i], g.versions[i]) {
                    (0, None) => {
                        prop_assert_eq!(g.logprobs[i], 0.0);
                        i += 1;
                    }
                    (1, Some(t)) => {
                        let s = &samples_by_tag[&t];
                        prop_assert!(i + s.len() <= len, "sample {t} cut short");
                        for (k, (id, lp)) in s.iter().enumerate() {
                            prop_assert_eq!(g.token_ids[i + k], *id);
                            prop_assert_eq!(g.logprobs[i + k], *lp);
                            prop_assert_eq!(g.loss_mask[i + k], 1);
                            prop_assert_eq!(g.versions[i + k], Some(t));
                        }
                        i += s.len();
                    }
                    (m, v) => prop_assert!(false, "mask {m} with version {v:?} at {i}"),
                }
            }
        }
        let episode = Episode {
            index: 0,
            session: "s".into(),
            task: json!({}),
            status: EpisodeStatus::Completed,
            reason: None,
            reward: 1.0,
            info: Default::default(),
            seconds: 0.0,
            segments,
        };
        let limits = EpisodeLimits {
            vocab_size: Some(tok.vocab_size()),
            max_positions: None,
            experts: None,
        };
        prop_assert_eq!(validate(&episode, &limits, tag), Ok(()));
        // The agent's next request: the reply it kept, treated as this case says.
        let keep = turn.keep.index(n.max(1)).min(texts.len().saturating_sub(1));
        let got = texts
            .get(keep)
            .map(|_| tok.decode(&sampled[keep].token_ids, true).unwrap())
            .unwrap_or_default();
        match &turn.history {
            History::Keep => messages.push(reply(&got, case.anthropic)),
            History::Edit(t) => messages.push(reply(t, case.anthropic)),
            History::Raw => messages.push(reply(
                texts.get(keep).map_or("", String::as_str),
                case.anthropic,
            )),
            History::Compact(k) => {
                messages.push(reply(&got, case.anthropic));
                let k = (*k).min(messages.len() - 1);
                messages.drain(..k);
            }
        }
    }
    Ok(())
}

pub fn target(budget: Budget) -> Row {
    drive("chat_segments", budget, 400, case(), run)
}
