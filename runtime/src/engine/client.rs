//! A client of the engine API (docs/engine.md) for token-in/token-out generation: the built-in
//! engine, vLLM or the router in front of either, all the same over HTTP. A generation may carry
//! a session id (header [`SESSION_HEADER`]) so that a router keeps a session on one engine.
//!
//! Generation always streams, so a turn sees each token as it is sampled and an abandoned turn
//! stops the engine within a token: dropping a [`GenerationStream`] before it finished closes the
//! connection and also sends `abort_requests`, so no engine (nor a router in between) keeps
//! generating for nobody.
//!
//! A token is handed on only once its policy version is known. The built-in engine and the router
//! put version spans in every chunk; vLLM sends them only with the last chunk of a stream (the
//! others carry `weight_versions: null`), so tokens from vLLM are held until then and released
//! with the versions that produced them (docs/engine.md, "vLLM"). A stream that breaks off first
//! releases nothing it held: the router continues the request from the tokens it did release.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::{Stream, StreamExt};
use serde::Serialize;

/// What a client sends beside the token ids (defined with the other wire shapes).
pub use crate::engine::api::ContentPart;
use crate::engine::api::{Choice, GenerateResponse, TokenLogprob};

/// Errors of talking to the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The engine refused the request (its status and message): bad input, context too long.
    #[error("the engine refused the request ({status}): {message}")]
    Refused { status: u16, message: String },
    #[error("cannot reach the engine at {url}: {source}")]
    Unreachable {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("the engine's stream broke off: {0}")]
    Stream(String),
}

/// `sampling_params` of a generate request.
#[derive(Debug, Clone, Default, Serialize)]
pub struct EngineSampling {
    /// `None`: up to the context length.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    pub temperature: f64,
    pub top_p: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    pub logprobs: usize,
    pub routed_experts_prompt_start: usize,
}

#[derive(Debug, Clone, Serialize)]
struct GenerateBody<'a, S> {
    request_id: &'a str,
    token_ids: &'a [i64],
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    content_parts: &'a [ContentPart],
    sampling_params: &'a S,
    stream: bool,
    /// The LoRA adapter to generate with, by name (vLLM's `model`); none: the served model.
    #[serde(skip_serializing_if = "Option::is_none")]
    model: Option<&'a str>,
}

/// The largest generate request an engine (or a router in front of engines) takes: images travel
/// inline as base64 data URLs (a 12-megapixel PNG is ~25 MiB); token ids alone stay far below
/// axum's 2 MiB default.
pub const GENERATE_BODY_LIMIT: usize = 64 << 20;

/// The largest adapter `PUT /v1/adapters/{name}` takes (rank 512 on every projection of an 8B
/// model in float32 is about 1.5 GB; a pool's `maxRank` bounds it further).
pub const ADAPTER_BODY_LIMIT: usize = 2 << 30;

/// The request header naming the session a generation belongs to (routers hash on it).
pub const SESSION_HEADER: &str = "x-moult-session";

/// One event of a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum Generated {
    Token {
        id: i64,
        logprob: f32,
        /// Top alternatives `(id, logprob)`, when asked for.
        top: Vec<(i64, f32)>,
        version: u64,
    },
    Finished {
        /// `stop` (EOS or a stop id) or `length`.
        reason: String,
        routed_experts: Option<String>,
    },
}

#[derive(Debug, Clone)]
pub struct EngineClient {
    http: reqwest::Client,
    base: String,
}

impl EngineClient {
    pub fn new(base_url: &str) -> Self {
        Self::with(crate::auth::client(), base_url)
    }

    /// A client of an engine behind a router: it sends a run's pool credential on an EnginePool
    /// ([`crate::auth::engine_client`]).
    pub fn engine(base_url: &str) -> Self {
        Self::with(crate::auth::engine_client(), base_url)
    }

    fn with(http: reqwest::Client, base_url: &str) -> Self {
        Self {
            http,
            base: base_url.trim_end_matches('/').to_string(),
        }
    }

    pub fn url(&self) -> &str {
        &self.base
    }

    /// Starts generating; the stream yields each sampled token, then `Finished`. `sampling` is
    /// the `sampling_params` object ([`EngineSampling`], or the JSON a client sent);
    /// `content_parts` the prompt's images (none for text).
    pub async fn generate<S: Serialize>(
        &self,
        request_id: String,
        prompt: &[i64],
        content_parts: &[ContentPart],
        sampling: &S,
        session: Option<&str>,
    ) -> Result<GenerationStream, EngineError> {
        self.generate_with(request_id, prompt, content_parts, sampling, session, None)
            .await
    }

    /// [`EngineClient::generate`] with the LoRA adapter `model` (none: the served model).
    pub async fn generate_with<S: Serialize>(
        &self,
        request_id: String,
        prompt: &[i64],
        content_parts: &[ContentPart],
        sampling: &S,
        session: Option<&str>,
        model: Option<&str>,
    ) -> Result<GenerationStream, EngineError> {
        let body = GenerateBody {
            request_id: &request_id,
            token_ids: prompt,
            content_parts,
            sampling_params: sampling,
            stream: true,
            model,
        };
        let url = format!("{}/inference/v1/generate", self.base);
        let mut request = self.http.post(&url).json(&body);
        if let Some(session) = session {
            request = request.header(SESSION_HEADER, session);
        }
        let response = request
            .send()
            .await
            .map_err(|source| EngineError::Unreachable { url, source })?;
        let response = accepted(response).await?;
        Ok(GenerationStream {
            body: response.bytes_stream().boxed(),
            decoder: SseDecoder::default(),
            pending: VecDeque::new(),
            finished: false,
            abort: Some((self.clone(), request_id, session.map(str::to_string))),
        })
    }

    /// The logprob of each of `tokens` given the tokens before it, under the engine's raw
    /// distribution (temperature 1): one non-streaming request with `prompt_logprobs: 0` and one
    /// token to generate, which the built-in engine and vLLM both answer. Entry 0 (nothing
    /// predicts the first token) is 0.
    pub async fn prompt_logprobs(
        &self,
        request_id: &str,
        tokens: &[i64],
    ) -> Result<Vec<f32>, EngineError> {
        let body = GenerateBody {
            request_id,
            token_ids: tokens,
            content_parts: &[],
            sampling_params: &serde_json::json!({
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
                "detokenize": false,
            }),
            stream: false,
            model: None,
        };
        let url = format!("{}/inference/v1/generate", self.base);
        let response = self
            .http
            .post(&url)
            .json(&body)
            .send()
            .await
            .map_err(|source| EngineError::Unreachable {
                url: url.clone(),
                source,
            })?;
        let response: GenerateResponse = accepted(response)
            .await?
            .json()
            .await
            .map_err(|e| EngineError::Stream(format!("reading {url}: {e}")))?;
        let rows = response.prompt_logprobs.ok_or_else(|| {
            EngineError::Stream(format!("{url} answered without prompt_logprobs"))
        })?;
        if rows.len() != tokens.len() {
            return Err(EngineError::Stream(format!(
                "{url} scored {} prompt tokens of {}",
                rows.len(),
                tokens.len()
            )));
        }
        let mut out = vec![0.0; tokens.len()];
        for (p, row) in rows.iter().enumerate().skip(1) {
            out[p] = row
                .as_ref()
                .and_then(|entries| entries.get(&tokens[p]))
                .map(|e| e.logprob)
                .ok_or_else(|| {
                    EngineError::Stream(format!(
                        "{url}: prompt_logprobs[{p}] has no entry for the prompt's token {}",
                        tokens[p]
                    ))
                })?;
        }
        Ok(out)
    }

    /// `POST /inference/v1/abort_requests` of requests started under `session` (a router aborts
    /// only those); failures are logged (the request may be gone already).
    pub async fn abort(&self, request_ids: Vec<String>, session: Option<&str>) {
        let url = format!("{}/inference/v1/abort_requests", self.base);
        let body = serde_json::json!({ "request_ids": request_ids });
        let mut request = self.http.post(&url).json(&body);
        if let Some(session) = session {
            request = request.header(SESSION_HEADER, session);
        }
        if let Err(e) = request.send().await {
            tracing::debug!(error = %e, "abort_requests failed");
        }
    }
}

/// The response if its status is a success; otherwise the engine's refusal, with the message
/// of its JSON error body (or the body as it is).
async fn accepted(response: reqwest::Response) -> Result<reqwest::Response, EngineError> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let text = response.text().await.unwrap_or_default();
    let message = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or(text);
    Err(EngineError::Refused {
        status: status.as_u16(),
        message,
    })
}

type ByteStream = Pin<Box<dyn Stream<Item = reqwest::Result<bytes::Bytes>> + Send>>;

/// The events of one streaming generation.
pub struct GenerationStream {
    body: ByteStream,
    decoder: SseDecoder,
    pending: VecDeque<Result<Generated, EngineError>>,
    finished: bool,
    /// Sent `abort_requests` on drop unless the generation finished (with the id the engine
    /// reports once it does: vLLM prefixes the id it was given), under the request's session.
    abort: Option<(EngineClient, String, Option<String>)>,
}

impl std::fmt::Debug for GenerationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GenerationStream")
            .field("finished", &self.finished)
            .finish()
    }
}

impl Drop for GenerationStream {
    fn drop(&mut self) {
        if let Some((client, id, session)) = self.abort.take() {
            let id = self.decoder.chunks.engine_request_id.take().unwrap_or(id);
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move { client.abort(vec![id], session.as_deref()).await });
            }
        }
    }
}

/// Turns the SSE `data:` payloads of one generation into [`Generated`] events, holding tokens
/// back until a chunk says which versions produced them.
#[derive(Debug, Default)]
struct ChunkParser {
    /// The latest tokens of the stream, received without version spans yet.
    held: Vec<TokenLogprob>,
    /// The version of the last span seen (for tokens a stream never labels).
    last_version: Option<u64>,
    /// The request id as the engine reports it.
    engine_request_id: Option<String>,
}

impl ChunkParser {
    /// Parses one payload, appending what it completes to `out`.
    fn chunk(&mut self, data: &str, out: &mut VecDeque<Result<Generated, EngineError>>) {
        let value: serde_json::Value = match serde_json::from_str(data) {
            Ok(v) => v,
            Err(e) => {
                out.push_back(Err(EngineError::Stream(format!("bad chunk {data:?}: {e}"))));
                return;
            }
        };
        if let Some(err) = value.get("error") {
            let status = err["code"].as_u64().unwrap_or(500) as u16;
            let message = err["message"]
                .as_str()
                .unwrap_or("engine error")
                .to_string();
            out.push_back(Err(EngineError::Refused { status, message }));
            return;
        }
        let chunk: GenerateResponse = match serde_json::from_value(value) {
            Ok(c) => c,
            Err(e) => {
                out.push_back(Err(EngineError::Stream(format!("bad chunk {data:?}: {e}"))));
                return;
            }
        };
        if self.engine_request_id.is_none() {
            self.engine_request_id = Some(chunk.request_id);
        }
        for choice in chunk.choices {
            self.choice(choice, out);
        }
    }

    fn choice(&mut self, choice: Choice, out: &mut VecDeque<Result<Generated, EngineError>>) {
        // Tokens are recorded with their logprobs: a chunk whose logprobs do not cover its
        // tokens (vLLM sends none unless `sampling_params.logprobs` is set) would lose them.
        let (tokens, logprobs) = (choice.token_ids.len(), choice.logprobs.content.len());
        if logprobs != tokens {
            out.push_back(Err(EngineError::Stream(format!(
                "a chunk carries {tokens} token ids but {logprobs} logprobs: set sampling_params.logprobs (0 or more)"
            ))));
            return;
        }
        self.held.extend(choice.logprobs.content);
        let spans = &choice.weight_versions;
        if let Some(end) = spans.iter().map(|s| s.end).max() {
            // The spans count from the first generated token of the request, and the held tokens
            // are the stream's latest: they end where the last span ends.
            let start = end.saturating_sub(self.held.len());
            for (i, lp) in self.held.drain(..).enumerate() {
                let at = start + i;
                let version = spans
                    .iter()
                    .find(|s| s.start <= at && at < s.end)
                    .or(spans.last())
                    .map_or(0, |s| s.version);
                out.push_back(Ok(token(lp, version)));
            }
            self.last_version = spans.last().map(|s| s.version);
        }
        if let Some(reason) = choice.finish_reason {
            if !self.held.is_empty() {
                // An engine that never labelled these tokens: the last version it named, if any.
                tracing::warn!(
                    tokens = self.held.len(),
                    "the engine finished a stream without weight_versions for its tokens"
                );
                let version = self.last_version.unwrap_or(0);
                for lp in self.held.drain(..) {
                    out.push_back(Ok(token(lp, version)));
                }
            }
            out.push_back(Ok(Generated::Finished {
                reason,
                routed_experts: choice.routed_experts,
            }));
        }
    }
}

fn token(lp: TokenLogprob, version: u64) -> Generated {
    Generated::Token {
        id: lp.token_id,
        logprob: lp.logprob,
        top: lp
            .top_logprobs
            .iter()
            .map(|t| (t.token_id, t.logprob))
            .collect(),
        version,
    }
}

impl Stream for GenerationStream {
    type Item = Result<Generated, EngineError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(item) = self.pending.pop_front() {
                if matches!(item, Ok(Generated::Finished { .. })) {
                    self.finished = true;
                    self.abort = None;
                }
                return Poll::Ready(Some(item));
            }
            if self.finished {
                return Poll::Ready(None);
            }
            match self.body.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.finished = true;
                    return Poll::Ready(Some(Err(EngineError::Stream(
                        "the engine closed the stream before the request finished".into(),
                    ))));
                }
                Poll::Ready(Some(Err(e))) => {
                    self.finished = true;
                    return Poll::Ready(Some(Err(EngineError::Stream(e.to_string()))));
                }
                Poll::Ready(Some(Ok(bytes))) => {
                    let this = &mut *self;
                    this.decoder.feed(&bytes, &mut this.pending);
                }
            }
        }
    }
}

/// The SSE body of one generation, fed in whatever pieces the network delivers: each complete
/// event's `data:` payloads are parsed in order, so any split of the same bytes gives the same
/// events.
#[derive(Debug, Default)]
pub struct SseDecoder {
    /// Bytes of an event not complete yet.
    buffer: Vec<u8>,
    /// How much of `buffer` holds no event end: each byte is searched once, however small the
    /// reads an event arrives in.
    searched: usize,
    chunks: ChunkParser,
}

impl SseDecoder {
    /// Takes the next bytes of the body, appending the events they complete to `out`.
    pub fn feed(&mut self, bytes: &[u8], out: &mut VecDeque<Result<Generated, EngineError>>) {
        self.buffer.extend_from_slice(bytes);
        loop {
            // An end straddling the searched part starts at most 3 bytes back.
            let from = self.searched.saturating_sub(3);
            let Some(end) = find_event_end(&self.buffer[from..]).map(|e| from + e) else {
                self.searched = self.buffer.len();
                return;
            };
            self.searched = 0;
            let event: Vec<u8> = self.buffer.drain(..end).collect();
            let text = String::from_utf8_lossy(&event);
            for line in text.lines() {
                let Some(data) = line.strip_prefix("data:") else {
                    continue;
                };
                let data = data.trim_start();
                if data != "[DONE]" {
                    self.chunks.chunk(data, out);
                }
            }
        }
    }
}

/// The end (after the blank line) of the first complete SSE event in `buf`.
fn find_event_end(buf: &[u8]) -> Option<usize> {
    buf.windows(2)
        .position(|w| w == b"\n\n")
        .map(|i| i + 2)
        .or_else(|| buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every event of a recorded SSE body, through the parser the stream uses.
    fn parse_sse(body: &str) -> Vec<Result<Generated, EngineError>> {
        let mut parser = ChunkParser::default();
        let mut out = VecDeque::new();
        for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
            if data != "[DONE]" {
                parser.chunk(data, &mut out);
            }
        }
        out.into_iter().collect()
    }

    fn fixture(name: &str) -> String {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/vllm_cpu")
            .join(name);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn a_real_vllm_stream_across_a_weight_update_labels_each_token_with_its_version() {
        // vLLM 0.32 (CPU) streamed 1500 tokens, paused with `keep` after 275, reloaded weights,
        // set version "1" and resumed; only the last chunk carries the spans.
        let events = parse_sse(&fixture("partial_rollout_stream.sse"));
        let versions: Vec<u64> = events
            .iter()
            .filter_map(|e| match e.as_ref().unwrap() {
                Generated::Token { version, .. } => Some(*version),
                Generated::Finished { .. } => None,
            })
            .collect();
        assert_eq!(versions.len(), 1500);
        assert!(
            versions[..275].iter().all(|&v| v == 0),
            "\"default\" is version 0"
        );
        assert!(versions[275..].iter().all(|&v| v == 1));
        assert!(matches!(
            events.last().unwrap().as_ref().unwrap(),
            Generated::Finished { reason, .. } if reason == "length"
        ));
    }

    #[test]
    fn a_real_vllm_stream_gives_the_same_tokens_as_its_non_streaming_answer() {
        let events = parse_sse(&fixture("generate_stream.sse"));
        let streamed: Vec<(i64, f32, u64)> = events
            .iter()
            .filter_map(|e| match e.as_ref().unwrap() {
                Generated::Token {
                    id,
                    logprob,
                    version,
                    ..
                } => Some((*id, *logprob, *version)),
                Generated::Finished { .. } => None,
            })
            .collect();
        let whole: GenerateResponse = serde_json::from_str(&fixture("generate.json")).unwrap();
        let c = &whole.choices[0];
        let expected: Vec<(i64, f32, u64)> = c
            .logprobs
            .content
            .iter()
            .map(|lp| (lp.token_id, lp.logprob, 0))
            .collect();
        assert_eq!(streamed, expected, "same seed, same tokens and logprobs");
        assert_eq!(c.token_ids.len(), 6);
    }

    #[test]
    fn a_real_vllm_error_inside_a_stream_is_the_engines_refusal() {
        let events = parse_sse(&fixture("error_in_stream.sse"));
        match &events[..] {
            [Err(EngineError::Refused { status, message })] => {
                assert_eq!(*status, 400);
                assert!(message.contains("out of vocabulary"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn held_tokens_of_a_stream_that_never_labels_them_take_the_last_version_seen() {
        let mut parser = ChunkParser::default();
        let mut out = VecDeque::new();
        parser.chunk(
            r#"{"request_id":"a","choices":[{"token_ids":[1],"logprobs":{"content":[{"token_id":1,"logprob":-1.0}]},"finish_reason":null,"weight_versions":[{"version":"4","start":0,"end":1}]}]}"#,
            &mut out,
        );
        parser.chunk(
            r#"{"request_id":"a","choices":[{"token_ids":[2],"logprobs":{"content":[{"token_id":2,"logprob":-2.0}]},"finish_reason":null,"weight_versions":null}]}"#,
            &mut out,
        );
        assert_eq!(out.len(), 1, "the unlabelled token waits");
        parser.chunk(
            r#"{"request_id":"a","choices":[{"token_ids":[],"logprobs":null,"finish_reason":"abort","weight_versions":null}]}"#,
            &mut out,
        );
        let versions: Vec<u64> = out
            .iter()
            .filter_map(|e| match e.as_ref().unwrap() {
                Generated::Token { version, .. } => Some(*version),
                Generated::Finished { .. } => None,
            })
            .collect();
        assert_eq!(versions, [4, 4]);
        assert_eq!(parser.engine_request_id.as_deref(), Some("a"));
    }

    #[test]
    fn tokens_without_logprobs_are_an_error_not_a_silent_loss() {
        // vLLM's chunk when `sampling_params.logprobs` was not set.
        let mut parser = ChunkParser::default();
        let mut out = VecDeque::new();
        parser.chunk(
            r#"{"request_id":"a","choices":[{"index":0,"finish_reason":null,"token_ids":[1729],"routed_experts":null,"weight_versions":null,"logprobs":null}]}"#,
            &mut out,
        );
        match &out.iter().collect::<Vec<_>>()[..] {
            [Err(EngineError::Stream(message))] => {
                assert!(message.contains("sampling_params.logprobs"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn chunks_become_tokens_with_their_versions() {
        let mut parser = ChunkParser::default();
        let mut out = VecDeque::new();
        parser.chunk(
            r#"{"request_id":"a","choices":[{"index":0,"token_ids":[7],"logprobs":{"content":[{"token_id":7,"logprob":-0.25}]},"finish_reason":null,"routed_experts":null,"weight_versions":[{"version":3,"start":5,"end":6}]}]}"#,
            &mut out,
        );
        parser.chunk(
            r#"{"request_id":"a","choices":[{"index":0,"token_ids":[],"logprobs":{"content":[]},"finish_reason":"stop","routed_experts":"AAA","weight_versions":[]}],"usage":{"prompt_tokens":1,"completion_tokens":6,"total_tokens":7}}"#,
            &mut out,
        );
        parser.chunk(r#"{"error":{"message":"paused","code":503}}"#, &mut out);
        let items: Vec<_> = out.into_iter().collect();
        assert_eq!(
            items[0].as_ref().unwrap(),
            &Generated::Token {
                id: 7,
                logprob: -0.25,
                top: vec![],
                version: 3
            }
        );
        assert_eq!(
            items[1].as_ref().unwrap(),
            &Generated::Finished {
                reason: "stop".into(),
                routed_experts: Some("AAA".into())
            }
        );
        assert!(matches!(
            items[2],
            Err(EngineError::Refused { status: 503, .. })
        ));
    }

    #[test]
    fn events_end_at_blank_lines() {
        assert_eq!(find_event_end(b"data: x\n\ndata: y"), Some(9));
        assert_eq!(find_event_end(b"data: x\r\n\r\n"), Some(11));
        assert_eq!(find_event_end(b"data: x\n"), None);
    }
}
