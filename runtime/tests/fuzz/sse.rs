//! The SSE body of a generation ([`SseDecoder`]): any split of the same bytes into network reads
//! gives the same events, and the recorded vLLM streams, split anywhere, give every token and end
//! with their finish.

use std::collections::VecDeque;
use std::sync::OnceLock;

use proptest::prelude::*;

use crate::{drive, Budget, Row};
use moult_runtime::engine::client::{Generated, SseDecoder};

fn fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/vllm_cpu")
        .join(name);
    std::fs::read_to_string(path).unwrap()
}

/// The `data:` payloads of the recorded streams (tokens with and without versions, an error).
fn payloads() -> &'static Vec<String> {
    static P: OnceLock<Vec<String>> = OnceLock::new();
    P.get_or_init(|| {
        let mut out: Vec<String> = ["generate_stream.sse", "error_in_stream.sse"]
            .iter()
            .flat_map(|f| {
                fixture(f)
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
                    .collect::<Vec<_>>()
            })
            .collect();
        // The built-in engine's shape: version spans in every chunk.
        out.push(r#"{"request_id":"e-1","choices":[{"index":0,"token_ids":[5],"logprobs":{"content":[{"token_id":5,"logprob":-0.5}]},"finish_reason":null,"weight_versions":[{"version":3,"start":0,"end":1}]}]}"#.into());
        out.push(r#"{"request_id":"e-1","choices":[{"index":0,"token_ids":[6],"logprobs":{"content":[{"token_id":6,"logprob":-0.25}]},"finish_reason":"stop","routed_experts":"AAA","weight_versions":[{"version":"4","start":1,"end":2}]}]}"#.into());
        out
    })
}

#[derive(Debug, Clone)]
enum Line {
    Data(usize),
    DataNoSpace(usize),
    Done,
    Comment,
    Event,
    Raw(Vec<u8>),
}

fn line() -> impl Strategy<Value = Line> {
    let n = payloads().len();
    prop_oneof![
        8 => (0..n).prop_map(Line::Data),
        1 => (0..n).prop_map(Line::DataNoSpace),
        1 => Just(Line::Done),
        1 => Just(Line::Comment),
        1 => Just(Line::Event),
        1 => prop::collection::vec(any::<u8>(), 0..12).prop_map(Line::Raw),
    ]
}

#[derive(Debug, Clone)]
struct Case {
    /// Events of lines; each event ends with a blank line (LF or CRLF).
    events: Vec<(Vec<Line>, bool)>,
    edits: Vec<(prop::sample::Index, u8)>,
    cuts: Vec<prop::sample::Index>,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec((prop::collection::vec(line(), 1..3), any::<bool>()), 0..8),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
        prop::collection::vec(any::<prop::sample::Index>(), 0..16),
    )
        .prop_map(|(events, edits, cuts)| Case {
            events,
            edits,
            cuts,
        })
}

fn body(case: &Case) -> Vec<u8> {
    let p = payloads();
    let mut out = Vec::new();
    for (lines, crlf) in &case.events {
        let eol: &[u8] = if *crlf { b"\r\n" } else { b"\n" };
        for l in lines {
            match l {
                Line::Data(i) => out.extend(format!("data: {}", p[*i]).bytes()),
                Line::DataNoSpace(i) => out.extend(format!("data:{}", p[*i]).bytes()),
                Line::Done => out.extend(b"data: [DONE]"),
                Line::Comment => out.extend(b": keep-alive"),
                Line::Event => out.extend(b"event: message"),
                Line::Raw(b) => out.extend(b),
            }
            out.extend(eol);
        }
        out.extend(eol);
    }
    for (at, b) in &case.edits {
        if !out.is_empty() {
            let i = at.index(out.len());
            out[i] = *b;
        }
    }
    out
}

/// The events of `pieces` fed in order, as comparable text.
fn events(pieces: &[&[u8]]) -> Vec<String> {
    let mut decoder = SseDecoder::default();
    let mut out = VecDeque::new();
    for p in pieces {
        decoder.feed(p, &mut out);
    }
    out.into_iter()
        .map(|e| match e {
            Ok(g) => format!("{g:?}"),
            Err(e) => format!("error: {e}"),
        })
        .collect()
}

fn check(case: Case) -> Result<(), TestCaseError> {
    let bytes = body(&case);
    let whole = events(&[&bytes]);
    let mut at: Vec<usize> = case.cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
    at.extend([0, bytes.len()]);
    at.sort_unstable();
    at.dedup();
    let pieces: Vec<&[u8]> = at.windows(2).map(|w| &bytes[w[0]..w[1]]).collect();
    prop_assert_eq!(&events(&pieces), &whole);
    let bytewise: Vec<&[u8]> = bytes.chunks(1).collect();
    prop_assert_eq!(&events(&bytewise), &whole);
    Ok(())
}

/// The recorded 1,500-token stream across a weight update, cut at random places.
fn check_recorded(cuts: Vec<prop::sample::Index>) -> Result<(), TestCaseError> {
    static BODY: OnceLock<String> = OnceLock::new();
    let body = BODY.get_or_init(|| fixture("partial_rollout_stream.sse"));
    let bytes = body.as_bytes();
    let mut at: Vec<usize> = cuts.iter().map(|c| c.index(bytes.len() + 1)).collect();
    at.extend([0, bytes.len()]);
    at.sort_unstable();
    at.dedup();
    let mut decoder = SseDecoder::default();
    let mut out = VecDeque::new();
    for w in at.windows(2) {
        decoder.feed(&bytes[w[0]..w[1]], &mut out);
    }
    let tokens = out
        .iter()
        .filter(|e| matches!(e, Ok(Generated::Token { .. })))
        .count();
    prop_assert_eq!(tokens, 1500);
    let finished = matches!(out.back(), Some(Ok(Generated::Finished { .. })));
    prop_assert!(finished, "the stream did not end with its finish");
    Ok(())
}

pub fn target(budget: Budget) -> Row {
    let mut row = drive("sse_chunks", budget, 1500, case(), check);
    let recorded = drive(
        "sse_chunks",
        match budget {
            Budget::Timed(t) => Budget::Timed(t / 10),
            b => b,
        },
        20,
        prop::collection::vec(any::<prop::sample::Index>(), 0..64),
        check_recorded,
    );
    row.executions += recorded.executions;
    row.failures.extend(recorded.failures);
    row
}
