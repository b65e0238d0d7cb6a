//! Text as it streams in. Stop strings and tool calls ([`TextStream`]): whatever pieces the same
//! text arrives in, content once sent is never taken back, the pieces sent plus the rest are the
//! final content, and (with one stop string, or none that matches) the outcome is the one of the
//! text fed whole. Incremental detokenization ([`DecodeStream`]): the deltas of any id sequence
//! concatenate to a prefix of the full decode, and to all of it when it ends in a whole character.

use std::path::PathBuf;
use std::sync::OnceLock;

use proptest::prelude::*;

use crate::{drive, Budget, Row};
use moult_runtime::chat::{
    DecodeStream, Hermes, Llama3Json, MistralTools, NoTools, ParsedOutput, Pythonic, Tokenizer,
    ToolCallParser,
};
use moult_runtime::loopback::text_stream::{Streamed, TextStream};

/// Pieces that make stop strings, tags and calls likely to meet, and split characters.
const ATOMS: [&str; 35] = [
    "a",
    "b",
    "ab",
    "ST",
    "OP",
    "STOP",
    " ",
    "\n",
    "\n\n",
    "\t",
    "é",
    "日本",
    "🎉",
    "<",
    "<tool",
    "<tool_call>",
    "</tool_call>",
    "_call>",
    "{\"name\": \"f\", \"arguments\": {\"x\": 1}}",
    "{\"name\": 1}",
    "{",
    "}",
    "\"",
    "</",
    "[TOOL_CALLS]",
    "[TOOL",
    "[",
    "]",
    "<|python_tag|>",
    "; ",
    "[f(a=1, b='x')]",
    "g(",
    ")",
    "=",
    "'",
];

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::collection::vec(prop::sample::select(ATOMS.to_vec()), 0..24)
            .prop_map(|v| v.concat()),
        1 => ".{0,40}",
    ]
}

fn stops() -> impl Strategy<Value = Vec<String>> {
    let stop = prop_oneof![
        3 => prop::collection::vec(prop::sample::select(ATOMS.to_vec()), 1..3)
            .prop_map(|v| v.concat()),
        1 => ".{1,4}",
    ];
    prop::collection::vec(stop, 0..=4)
}

#[derive(Debug, Clone)]
struct Case {
    text: String,
    /// Cut points, as fractions of the text (moved to character boundaries).
    cuts: Vec<prop::sample::Index>,
    stops: Vec<String>,
    /// Which parser: none, Hermes, Llama 3 JSON, Mistral, Pythonic.
    parser: u8,
}

fn case() -> impl Strategy<Value = Case> {
    (
        text(),
        prop::collection::vec(any::<prop::sample::Index>(), 0..12),
        stops(),
        0..5u8,
    )
        .prop_map(|(text, cuts, stops, parser)| Case {
            text,
            cuts,
            stops,
            parser,
        })
}

fn pieces(text: &str, cuts: &[prop::sample::Index]) -> Vec<String> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| {
            let mut i = c.index(text.len() + 1);
            while !text.is_char_boundary(i) {
                i -= 1;
            }
            i
        })
        .collect();
    at.push(0);
    at.push(text.len());
    at.sort_unstable();
    at.dedup();
    at.windows(2)
        .map(|w| text[w[0]..w[1]].to_string())
        .collect()
}

#[derive(Debug, PartialEq)]
struct Outcome {
    sent: String,
    stopped: Option<String>,
    text: String,
    parsed: ParsedOutput,
    rest: String,
}

fn feed(pieces: &[String], stops: &[String], parser: &dyn ToolCallParser) -> Outcome {
    let mut stream = TextStream::new(stops, parser);
    let (mut sent, mut stopped) = (String::new(), None);
    for p in pieces {
        match stream.push(p) {
            Streamed::Content(c) => sent.push_str(&c),
            Streamed::Stopped(s) => {
                stopped = Some(s);
                break;
            }
        }
    }
    let text = stream.text().to_string();
    let (parsed, rest) = stream.finish();
    Outcome {
        sent,
        stopped,
        text,
        parsed,
        rest,
    }
}

fn check_outcome(o: &Outcome, whole: &str, stops: &[String]) -> Result<(), TestCaseError> {
    let content = o.parsed.content.clone().unwrap_or_default();
    prop_assert_eq!(
        format!("{}{}", o.sent, o.rest),
        content,
        "what was streamed plus the rest is not the final content"
    );
    prop_assert!(whole.starts_with(&o.text));
    for s in stops {
        prop_assert!(!o.text.contains(s.as_str()), "{s:?} left in {:?}", o.text);
    }
    match &o.stopped {
        Some(s) => prop_assert!(whole[o.text.len()..].starts_with(s.as_str())),
        None => prop_assert_eq!(&o.text, whole),
    }
    Ok(())
}

fn check(case: Case) -> Result<(), TestCaseError> {
    let parser: &dyn ToolCallParser = match case.parser {
        0 => &NoTools,
        1 => &Hermes,
        2 => &Llama3Json,
        3 => &MistralTools,
        _ => &Pythonic,
    };
    let split = pieces(&case.text, &case.cuts);
    let whole = feed(std::slice::from_ref(&case.text), &case.stops, parser);
    let streamed = feed(&split, &case.stops, parser);
    check_outcome(&whole, &case.text, &case.stops)?;
    check_outcome(&streamed, &case.text, &case.stops)?;
    let matched = case.stops.iter().any(|s| case.text.contains(s.as_str()));
    if case.stops.len() <= 1 || !matched {
        // Fed whole, one push sends everything up to the end at once; compare the outcome.
        prop_assert_eq!(&streamed.stopped, &whole.stopped);
        prop_assert_eq!(&streamed.text, &whole.text);
        prop_assert_eq!(&streamed.parsed, &whole.parsed);
    }
    Ok(())
}

pub fn target(budget: Budget) -> Row {
    drive("stream_stops_and_tools", budget, 10_000, case(), check)
}

/// `tests/fixtures/tiny_bpe`: a byte-level BPE of 2,000 tokens with Qwen's special tokens.
pub fn tiny_tokenizer_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("fuzz-tiny-bpe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            fixtures.join("tiny_bpe/tiny_bpe_tokenizer.json"),
            dir.join("tokenizer.json"),
        )
        .unwrap();
        dir
    })
    .clone()
}

pub fn tiny_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_model_dir(&tiny_tokenizer_dir()).unwrap())
}

fn ids() -> impl Strategy<Value = Vec<i64>> {
    let id = prop_oneof![
        20 => 0i64..2003,
        // Single bytes of the byte-level alphabet: split characters and invalid UTF-8.
        10 => 0i64..256,
        1 => prop::sample::select(vec![2000i64, 2001, 2002, 2003, 5000, -1, i64::MAX]),
    ];
    prop::collection::vec(id, 0..40)
}

fn check_detok(ids: Vec<i64>, skip_special: bool) -> Result<(), TestCaseError> {
    let tok = tiny_tokenizer();
    let mut stream = DecodeStream::new(skip_special);
    let mut text = String::new();
    for (i, &id) in ids.iter().enumerate() {
        match stream.step(tok, id) {
            Ok(delta) => text.push_str(&delta),
            Err(_) => {
                // Only an id the tokenizer cannot take (negative, or past u32).
                prop_assert!(u32::try_from(id).is_err(), "id {id} at {i} refused");
                return Ok(());
            }
        }
    }
    let full = tok.decode(&ids, skip_special).unwrap();
    prop_assert!(
        full.starts_with(&text),
        "streamed {text:?} is not a prefix of {full:?}"
    );
    if !full.ends_with('\u{FFFD}') {
        prop_assert_eq!(text, full);
    }
    Ok(())
}

pub fn detok_target(budget: Budget) -> Row {
    drive(
        "incremental_detok",
        budget,
        3000,
        (ids(), any::<bool>()),
        |(ids, skip)| check_detok(ids, skip),
    )
}
