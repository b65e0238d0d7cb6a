//! One chat turn, protocol-neutral: render the conversation with the model's chat template,
//! account its tokens against the session ([`super::session`]), generate token-in/token-out on the
//! engine, turn the sampled ids into text and tool calls, and record the turn once it finished.
//!
//! The OpenAI and Anthropic adapters call [`ChatService::turn`] with the internal request; while
//! the turn runs, content text that is certainly final streams to them as [`TurnEvent`]s. A turn
//! whose client went away (its event channel closed) stops its engine requests and records
//! nothing.

use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc;

use super::error::LoopbackError;
use super::session::{Encoded, Sampled, Segment, SegmentImage, Session};
use super::text_stream::{Streamed, TextStream};
use super::turn::{ChoiceOutput, Finish, TokenInfo, TurnEvent, TurnOutput, TurnResult};
use crate::chat::{
    parser_for_template, ChatRequest, ChatTemplate, DecodeStream, Image, InvalidRequest, NoTools,
    SamplingOverride, TemplateError, Tokenizer, TokenizerError, ToolCallParser,
};
use crate::engine::client::{ContentPart, EngineClient, EngineError, EngineSampling, Generated};
use crate::vision::{ImageProcessorConfig, VisionError};

/// Events buffered between a turn and a slow streaming client; past that the turn waits (and the
/// engine keeps the tokens), so a stalled client costs memory proportional to this, not to the
/// output.
const TURN_EVENT_BUFFER: usize = 256;

/// Where a turn streams its content as it is generated; `None`: the client does not stream.
pub type Events = Option<mpsc::Sender<TurnEvent>>;

/// What every sample of one turn shares.
struct SampleContext<'a> {
    session: &'a str,
    prompt: &'a [i64],
    /// The prompt's images, for the engine.
    content_parts: &'a Vec<ContentPart>,
    /// Sample `i` gets seed `seed + i`.
    sampling: EngineSampling,
    stop: &'a [String],
    parser: &'a dyn ToolCallParser,
    id_prefix: &'a str,
    events: Events,
    cancelled: &'a AtomicBool,
}

/// Settings of a loopback server.
#[derive(Debug, Clone)]
pub struct ServiceOptions {
    /// Sessions kept at once; more get 429 until some are taken, deleted or expire.
    pub max_sessions: usize,
    /// The name answered by `/v1/models` and echoed in responses.
    pub model_name: String,
    /// Whether sessions exist only once opened with [`ChatService::open`] (the agent pool's:
    /// a request for any other session, such as a leftover agent process's after its episode
    /// ended, gets 404). Otherwise a session is made on its first request (`moult chat`).
    pub registered_sessions: bool,
    /// A session unused for this long is dropped when a new one is made.
    pub session_idle: Option<Duration>,
    /// Turns one session may take; more get 429.
    pub max_turns: usize,
    /// Tokens one session may record (over all its segments, open candidates included); a turn
    /// that starts with this many recorded gets 429.
    pub max_session_tokens: usize,
}

impl ServiceOptions {
    /// The agent pool's settings: registered sessions (the pool takes each when its episode
    /// ends), at most `max_sessions` at once and [`DEFAULT_MAX_TURNS`] turns each.
    pub fn pool(max_sessions: usize, model_name: impl Into<String>) -> Self {
        Self {
            max_sessions,
            model_name: model_name.into(),
            registered_sessions: true,
            session_idle: None,
            max_turns: DEFAULT_MAX_TURNS,
            max_session_tokens: DEFAULT_MAX_SESSION_TOKENS,
        }
    }
}

/// Turns a session may take unless configured otherwise.
pub const DEFAULT_MAX_TURNS: usize = 1024;

/// Tokens a session may record unless configured otherwise: room for a long agentic episode
/// whose template rewrites history every turn (a new segment each time: 100 turns of 80k tokens),
/// while one runaway session holds at most a few hundred MB.
pub const DEFAULT_MAX_SESSION_TOKENS: usize = 8 << 20;

/// A session, its cancel flag (which lives outside the lock a running turn holds) and when it
/// was last used.
#[derive(Debug)]
struct SessionSlot {
    cancelled: AtomicBool,
    /// Sampling every turn of the session gets, whatever its requests ask for.
    sampling: Option<SamplingOverride>,
    state: tokio::sync::Mutex<Session>,
    used: Mutex<Instant>,
}

impl SessionSlot {
    fn touch(&self) {
        *self.used.lock().expect("session use lock") = Instant::now();
    }

    fn idle(&self) -> Duration {
        self.used.lock().expect("session use lock").elapsed()
    }
}

/// How a vision-language model's prompts hold images (docs/vision.md): the chat template renders
/// one `placeholder` token per image, and the prompt holds as many as the image's patches make.
#[derive(Debug, Clone)]
pub struct ImageInputs {
    pub config: ImageProcessorConfig,
    /// The id of `<|image_pad|>`.
    pub placeholder: i64,
}

/// The placeholder token of Qwen2-VL and Qwen2.5-VL chat templates.
const IMAGE_PLACEHOLDER: &str = "<|image_pad|>";

/// Why the model folder a service is made from cannot serve.
#[derive(Debug, thiserror::Error)]
pub enum ModelDirError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Vision(#[from] VisionError),
    #[error("{}: the model has a preprocessor_config.json, but its tokenizer has no {IMAGE_PLACEHOLDER} token (docs/vision.md)", .0.display())]
    NoImagePlaceholder(PathBuf),
}

impl ImageInputs {
    /// A model folder's: `Some` when it has a `preprocessor_config.json` and its tokenizer the
    /// image placeholder token; `None` for a text-only model.
    pub fn from_model_dir(
        dir: &Path,
        tokenizer: &Tokenizer,
    ) -> Result<Option<Self>, ModelDirError> {
        if !dir.join("preprocessor_config.json").is_file() {
            return Ok(None);
        }
        let config = ImageProcessorConfig::from_model_dir(dir)?;
        let missing = || ModelDirError::NoImagePlaceholder(dir.into());
        let placeholder = tokenizer.token_id(IMAGE_PLACEHOLDER).ok_or_else(missing)?;
        Ok(Some(Self {
            config,
            placeholder,
        }))
    }
}

/// The loopback server's state: model files, engine client and sessions.
#[derive(Debug)]
pub struct ChatService {
    engine: EngineClient,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    /// A vision-language model's; `None`: requests with images are refused.
    images: Option<ImageInputs>,
    tool_parser: Box<dyn ToolCallParser>,
    opts: ServiceOptions,
    sessions: Mutex<HashMap<String, Arc<SessionSlot>>>,
}

/// A hash of a request without its messages (which retries compare separately, cheaply), and of
/// the protocol's tool-call id prefix (the answers of the protocols differ).
fn request_key(id_prefix: &str, req: &ChatRequest) -> u64 {
    let (tools, sampling, kwargs) = (&req.tools, &req.sampling, &req.template_kwargs);
    let rest = (tools, req.parse_tool_calls, sampling, req.n, kwargs);
    let rest = serde_json::to_string(&rest).expect("a chat request serializes");
    BuildHasherDefault::<DefaultHasher>::default().hash_one((id_prefix, rest))
}

/// Streams `text` of sample `choice` to the client, if it streams and there is any.
async fn emit(events: &Events, choice: usize, text: String) -> Result<(), LoopbackError> {
    let Some(tx) = events.as_ref().filter(|_| !text.is_empty()) else {
        return Ok(());
    };
    let sent = tx.send(TurnEvent { choice, text }).await;
    sent.map_err(|_| LoopbackError::ClientGone)
}

impl ChatService {
    /// A service for the model in `model_dir` (tokenizer.json and a chat template) generating on
    /// the engine at `engine`.
    pub fn new(
        engine: EngineClient,
        tokenizer: Tokenizer,
        template: ChatTemplate,
        opts: ServiceOptions,
    ) -> Self {
        Self {
            engine,
            tokenizer,
            tool_parser: parser_for_template(template.source()),
            template,
            images: None,
            opts,
            sessions: Mutex::new(HashMap::new()),
        }
    }

    /// The service of the model in `dir` (its tokenizer, chat template and, for a
    /// vision-language model, image settings) on the engine (or router) at `engine`.
    pub fn from_model_dir(
        engine: &str,
        dir: &Path,
        opts: ServiceOptions,
    ) -> Result<Self, ModelDirError> {
        let tokenizer = Tokenizer::from_model_dir(dir)?;
        let template = ChatTemplate::from_model_dir(dir)?;
        let images = ImageInputs::from_model_dir(dir, &tokenizer)?;
        Ok(Self::new(EngineClient::new(engine), tokenizer, template, opts).with_images(images))
    }

    /// Takes images as `images` says (`None`: refuses them).
    pub fn with_images(mut self, images: Option<ImageInputs>) -> Self {
        self.images = images;
        self
    }

    pub fn model_name(&self) -> &str {
        &self.opts.model_name
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    fn sessions(&self) -> MutexGuard<'_, HashMap<String, Arc<SessionSlot>>> {
        self.sessions.lock().expect("sessions lock")
    }

    /// The session `id`: made here unless sessions are registered ([`Self::open`]).
    fn session(&self, id: &str) -> Result<Arc<SessionSlot>, LoopbackError> {
        let mut sessions = self.sessions();
        if let Some(s) = sessions.get(id) {
            s.touch();
            return Ok(s.clone());
        }
        if self.opts.registered_sessions {
            let why = format!("no session {id}: sessions are opened by the agent pool for an episode and end with it");
            return Err(LoopbackError::NotFound(why));
        }
        self.insert(&mut sessions, id, None)
    }

    /// Opens session `id` for an episode (the agent pool, before it starts the agent); with
    /// `sampling`, its turns sample that way whatever the agent asks (evaluation episodes).
    pub fn open(&self, id: &str, sampling: Option<SamplingOverride>) -> Result<(), LoopbackError> {
        let mut sessions = self.sessions();
        if sessions.contains_key(id) {
            let message = format!("session {id} is open already");
            return Err(InvalidRequest::new("session", message).into());
        }
        self.insert(&mut sessions, id, sampling).map(drop)
    }

    fn insert(
        &self,
        sessions: &mut HashMap<String, Arc<SessionSlot>>,
        id: &str,
        sampling: Option<SamplingOverride>,
    ) -> Result<Arc<SessionSlot>, LoopbackError> {
        if let Some(idle) = self.opts.session_idle {
            // Sessions nobody used for `idle` are dropped, with any turn of theirs still running.
            for s in sessions.values().filter(|s| s.idle() >= idle) {
                s.cancelled.store(true, Ordering::Relaxed);
            }
            sessions.retain(|_, s| !s.cancelled.load(Ordering::Relaxed));
        }
        if sessions.len() >= self.opts.max_sessions {
            return Err(LoopbackError::TooManySessions(self.opts.max_sessions));
        }
        let s = Arc::new(SessionSlot {
            cancelled: AtomicBool::new(false),
            sampling,
            state: tokio::sync::Mutex::new(Session::default()),
            used: Mutex::new(Instant::now()),
        });
        sessions.insert(id.to_string(), s.clone());
        Ok(s)
    }

    /// The segments recorded so far for `session` (waits for a running turn to finish).
    pub async fn trajectory(&self, session: &str) -> Option<(usize, Vec<Segment>)> {
        let slot = self.sessions().get(session)?.clone();
        let s = slot.state.lock().await;
        Some((s.turns(), s.segments()))
    }

    /// Removes a session and returns its segments (the episode is over). A turn still running
    /// is cancelled: it stops its engine requests at the next token and records nothing.
    pub async fn take(&self, session: &str) -> Option<Vec<Segment>> {
        let slot = self.sessions().remove(session)?;
        slot.cancelled.store(true, Ordering::Relaxed);
        let s = slot.state.lock().await;
        Some(s.segments())
    }

    /// Runs a turn of `session` on a task of its own; its content streams on the receiver as it
    /// is generated (a client that stops reading cancels it).
    pub fn spawn_turn(
        self: &Arc<Self>,
        session: String,
        id_prefix: &'static str,
        req: ChatRequest,
    ) -> (mpsc::Receiver<TurnEvent>, impl Future<Output = TurnResult>) {
        let (tx, rx) = mpsc::channel(TURN_EVENT_BUFFER);
        let this = self.clone();
        let turn = tokio::spawn(async move { this.turn(&session, id_prefix, req, Some(tx)).await });
        let turn = turn.map(|r| r.unwrap_or_else(|e| Err(LoopbackError::Panicked(e.to_string()))));
        (rx, turn)
    }

    /// Runs one turn of `session`; `id_prefix` starts tool-call ids (`call_`, `toolu_`).
    pub async fn turn(
        &self,
        session_id: &str,
        id_prefix: &str,
        mut req: ChatRequest,
        events: Events,
    ) -> TurnResult {
        self.check_tools(&req)?;
        let slot = self.session(session_id)?;
        if let Some(sampling) = &slot.sampling {
            sampling.apply(&mut req.sampling);
        }
        let mut session = slot.state.lock().await;
        if slot.cancelled.load(Ordering::Relaxed) {
            return Err(LoopbackError::NotFound("the session was closed".into()));
        }
        if session.turns() >= self.opts.max_turns {
            return Err(LoopbackError::TurnLimit(self.opts.max_turns));
        }
        if session.tokens() >= self.opts.max_session_tokens {
            return Err(LoopbackError::TokenLimit(self.opts.max_session_tokens));
        }
        let key = request_key(id_prefix, &req);
        if let Some(answer) = session.cached(key, &req.messages) {
            for (i, c) in answer.choices.iter().enumerate() {
                emit(&events, i, c.content.clone().unwrap_or_default()).await?;
            }
            return Ok(answer);
        }
        let rendered = req.render(&self.template)?;
        let plan = session.plan(&req.messages, rendered, |text, images| {
            self.encode_with_images(text, images)
        })?;
        let image = |i: &SegmentImage| ContentPart::image(&i.image.data_url);
        let sampling = &req.sampling;
        let ctx = SampleContext {
            session: session_id,
            prompt: &plan.engine_prompt(),
            content_parts: &plan.images.iter().map(image).collect(),
            sampling: EngineSampling {
                max_tokens: sampling.max_tokens,
                temperature: sampling.temperature.unwrap_or(1.0),
                top_p: sampling.top_p.unwrap_or(1.0),
                top_k: sampling.top_k,
                seed: sampling.seed,
                logprobs: sampling.logprobs.unwrap_or(0),
                routed_experts_prompt_start: plan.routed_experts_start(),
            },
            stop: &sampling.stop,
            parser: if req.parse_tool_calls {
                self.tool_parser.as_ref()
            } else {
                &NoTools
            },
            id_prefix,
            events,
            cancelled: &slot.cancelled,
        };
        let samples = (0..req.n).map(|i| self.sample(&ctx, i));
        let samples = futures::future::try_join_all(samples).await?;
        let (records, choices): (Vec<Sampled>, Vec<ChoiceOutput>) = samples.into_iter().unzip();
        let decode = |r: &Sampled| self.tokenizer.decode(&r.token_ids, false);
        let texts = records.iter().map(decode).collect::<Result<Vec<_>, _>>()?;
        let answer = Arc::new(TurnOutput {
            prompt_tokens: plan.prompt.len(),
            choices,
        });
        let messages = Arc::new(req.messages);
        session.commit(plan, messages.clone(), &records, texts);
        session.remember(key, messages, answer.clone());
        // Idle time counts from the end of the last turn.
        slot.touch();
        Ok(answer)
    }

    /// The ids of rendered `text`, each image placeholder expanded to the tokens its image takes
    /// (`images`: the images the text holds placeholders for, in order), and where each went.
    fn encode_with_images(&self, text: &str, images: &[&Image]) -> Result<Encoded, LoopbackError> {
        let ids = self.tokenizer.encode(text)?;
        let refuse = |message: &str| Err(InvalidRequest::new("messages", message).into());
        let n = images.len();
        let Some(inputs) = &self.images else {
            if images.is_empty() {
                return Ok((ids, Vec::new()));
            }
            return refuse(
                "the request has images, but this model takes none (its folder has no \
                 preprocessor_config.json); serve a vision-language model (docs/vision.md)",
            );
        };
        let mut out = Vec::with_capacity(ids.len());
        let mut spans = Vec::with_capacity(images.len());
        for id in ids {
            if id != inputs.placeholder {
                out.push(id);
                continue;
            }
            let Some(image) = images.get(spans.len()) else {
                return refuse(&format!("the conversation renders more image placeholders than it has images ({n} images); text may not hold {IMAGE_PLACEHOLDER} itself"));
            };
            let tokens = (image.bytes())
                .and_then(|b| crate::vision::placeholder_tokens_of(&b, &inputs.config))
                .map_err(|e| InvalidRequest::new("messages", format!("an image: {e}")))?;
            spans.push(SegmentImage {
                offset: out.len(),
                tokens,
                image: (*image).clone(),
            });
            out.extend(std::iter::repeat_n(inputs.placeholder, tokens));
        }
        if spans.len() != n {
            let (origin, found) = (self.template.origin(), spans.len());
            return refuse(&format!("the model's chat template ({origin}) rendered {found} image placeholders for {n} images: it does not render images (docs/vision.md)"));
        }
        Ok((out, spans))
    }

    /// Tools the chat template would drop are refused: a template that never reads `tools`
    /// (Gemma 3's official one) would render the request as if it had none, and the model could
    /// not call them.
    fn check_tools(&self, req: &ChatRequest) -> Result<(), InvalidRequest> {
        if req.tools.is_empty() || self.template.reads_tools() {
            return Ok(());
        }
        let origin = self.template.origin();
        let message = format!(
            "the request has tools, but the model's chat template ({origin}) never renders tools, \
             so the model would not see them; send the request without tools, or serve the model \
             with a chat template that renders them (docs/chat.md, \"Tool calls\")"
        );
        Err(InvalidRequest::new("tools", message))
    }

    async fn sample(
        &self,
        ctx: &SampleContext<'_>,
        index: usize,
    ) -> Result<(Sampled, ChoiceOutput), LoopbackError> {
        let mut sampling = ctx.sampling.clone();
        sampling.seed = sampling.seed.map(|s| s.wrapping_add(index as u64));
        let id = format!("lb-{}", super::random_id());
        let (prompt, parts, session) = (ctx.prompt, ctx.content_parts, Some(ctx.session));
        let generation = self.engine.generate(id, prompt, parts, &sampling, session);
        let mut stream = generation.await?;
        let mut text = TextStream::new(ctx.stop, ctx.parser);
        let mut record = Sampled::default();
        let mut tokens = Vec::new();
        let mut detok = DecodeStream::new(true);
        let unfinished = || EngineError::Stream("the stream ended without a finish".into());
        let finish = loop {
            match stream.next().await.ok_or_else(unfinished)?? {
                Generated::Token {
                    id,
                    logprob,
                    top,
                    version,
                } => {
                    let gone = ctx.events.as_ref().is_some_and(|tx| tx.is_closed());
                    if gone || ctx.cancelled.load(Ordering::Relaxed) {
                        return Err(LoopbackError::ClientGone);
                    }
                    record.token_ids.push(id);
                    record.logprobs.push(logprob);
                    record.versions.push(version);
                    tokens.push(TokenInfo { id, logprob, top });
                    match text.push(&detok.step(&self.tokenizer, id)?) {
                        Streamed::Stopped(stop) => break Finish::StopSequence(stop),
                        Streamed::Content(content) => emit(&ctx.events, index, content).await?,
                    }
                }
                Generated::Finished {
                    reason,
                    routed_experts,
                } => {
                    record.routed_experts = routed_experts;
                    break match reason.as_str() {
                        "length" => Finish::Length,
                        "stop" => Finish::Stop,
                        other => {
                            let e = format!("the engine ended the request with `{other}`");
                            return Err(EngineError::Stream(e).into());
                        }
                    };
                }
            }
        };
        // A stop string ended it early: the rest is not generated (dropping the stream aborts it).
        drop(stream);
        let (parsed, rest) = text.finish();
        emit(&ctx.events, index, rest).await?;
        let mut tool_calls = parsed.tool_calls;
        for call in &mut tool_calls {
            call.id = format!("{}{}", ctx.id_prefix, super::random_id());
        }
        let finish = match finish {
            Finish::Stop if !tool_calls.is_empty() => Finish::ToolCalls,
            other => other,
        };
        let choice = ChoiceOutput {
            content: parsed.content,
            tool_calls,
            finish,
            completion_tokens: record.token_ids.len(),
            tokens,
        };
        Ok((record, choice))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// Gemma 3's official template never reads `tools`: a request with tools is refused with a
    /// message naming the template file, before any session or engine is involved, and the
    /// same request without tools goes on.
    #[tokio::test]
    async fn tools_the_template_never_renders_are_refused() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        let dir = std::env::temp_dir().join(format!("moult-gemma3-tools-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(
            fixtures.join("tiny_bpe/tiny_bpe_tokenizer.json"),
            dir.join("tokenizer.json"),
        )
        .unwrap();
        std::fs::copy(
            fixtures.join("gemma3_it_chat_template.jinja"),
            dir.join("chat_template.jinja"),
        )
        .unwrap();
        let service = ChatService::new(
            // Nothing listens there: the engine must not be needed.
            EngineClient::new("http://127.0.0.1:9"),
            Tokenizer::from_model_dir(&dir).unwrap(),
            ChatTemplate::from_model_dir(&dir).unwrap(),
            ServiceOptions::pool(2, "gemma"),
        );
        let request = |tools: Value| -> ChatRequest {
            serde_json::from_value(json!({
                "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": tools,
                "parse_tool_calls": true,
                "sampling": {"stop": []},
                "n": 1,
                "template_kwargs": {}
            }))
            .unwrap()
        };
        let weather = json!([{"name": "get_weather", "parameters": {"type": "object"}}]);
        match service.turn("s1", "call_", request(weather), None).await {
            Err(LoopbackError::Invalid(e)) => {
                assert_eq!(e.param.as_deref(), Some("tools"));
                let file = dir.join("chat_template.jinja").display().to_string();
                assert!(e.message.contains(&file), "{}", e.message);
                assert!(e.message.contains("never renders tools"), "{}", e.message);
                assert!(e.message.contains("docs/chat.md"), "{}", e.message);
            }
            other => panic!("expected the tools to be refused, got {other:?}"),
        }
        // Without tools the request passes the check (and stops at the unopened session).
        match service.turn("s1", "call_", request(json!([])), None).await {
            Err(LoopbackError::NotFound(_)) => {}
            other => panic!("expected the unopened session's 404, got {other:?}"),
        }
    }
}
