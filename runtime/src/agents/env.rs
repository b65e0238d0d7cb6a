//! The `Env` agent form (docs/agents.md): a Gymnasium-shaped environment; the framework owns the LLM
//! loop. Environments are Rust types implementing [`Env`], or external processes speaking the JSON
//! protocol of `ExternalEnv` (the `process` module).

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};

use super::{AgentError, Result};
use crate::chat::{ChatRequest, ChatSampling, Image, Message, Part, Role};
use crate::loopback::ChatService;

/// What the model is shown: text, or text and images in order (a vision-language model's
/// observations; docs/vision.md). As JSON: a string, or an array of
/// `{"type": "text", "text"}` and `{"type": "image", "media_type": "image/png", "data": BASE64}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Observation {
    Text(String),
    Parts(Vec<ObservationPart>),
}

/// A piece of an observation with images.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum ObservationPart {
    Text { text: String },
    Image { media_type: String, data: String },
}

impl From<String> for Observation {
    fn from(text: String) -> Self {
        Self::Text(text)
    }
}

impl Observation {
    /// Its text (the text parts joined).
    pub fn text(&self) -> String {
        match self {
            Self::Text(text) => text.clone(),
            Self::Parts(parts) => parts
                .iter()
                .filter_map(|p| match p {
                    ObservationPart::Text { text } => Some(text.as_str()),
                    ObservationPart::Image { .. } => None,
                })
                .collect(),
        }
    }

    /// The user message that shows it to the model; an image that is not a PNG or JPEG in base64
    /// is the env's error.
    pub fn into_message(self) -> Result<Message> {
        let parts = match self {
            Self::Text(text) => return Ok(Message::text(Role::User, text)),
            Self::Parts(parts) => parts,
        };
        let parts = parts.into_iter().enumerate().map(|(i, p)| match p {
            ObservationPart::Text { text } => Ok(Part::Text { text }),
            ObservationPart::Image { media_type, data } => Image::from_base64(&media_type, &data)
                .map(|image| Part::Image { image })
                .map_err(|e| AgentError::Env(format!("observation part {i}: {e}"))),
        });
        let parts = parts.collect::<Result<_, _>>()?;
        Ok(Message::with_parts(Role::User, parts))
    }
}

/// What `step` returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepResult {
    pub observation: Observation,
    #[serde(default)]
    pub reward: f64,
    #[serde(default)]
    pub terminated: bool,
    #[serde(default)]
    pub truncated: bool,
    #[serde(default)]
    pub info: Map<String, Json>,
}

/// A Gymnasium-shaped environment: `reset(task) -> observation`, then `step(action)` with each
/// model reply until `terminated` or `truncated`.
pub trait Env: Send {
    fn reset<'a>(&'a mut self, task: &'a Json) -> BoxFuture<'a, Result<Observation>>;
    fn step<'a>(&'a mut self, action: &'a str) -> BoxFuture<'a, Result<StepResult>>;
}

/// How the framework drives an `Env`.
#[derive(Debug, Clone)]
pub struct EnvLoopOptions {
    /// Model turns per episode; the episode is truncated after the last.
    pub max_turns: usize,
    pub sampling: ChatSampling,
    /// A system message before the first observation.
    pub system_prompt: Option<String>,
    /// Extra chat-template variables (`enable_thinking`).
    pub template_kwargs: Map<String, Json>,
}

impl Default for EnvLoopOptions {
    fn default() -> Self {
        Self {
            max_turns: 8,
            sampling: ChatSampling::default(),
            system_prompt: None,
            template_kwargs: Map::new(),
        }
    }
}

/// Runs one episode: the observation goes to the model as a user message, its reply to `step`,
/// until the env says it is over or `max_turns` replies were made. The sum of the step rewards,
/// and the last step's info.
pub async fn run_env_episode(
    service: &ChatService,
    session: &str,
    env: &mut dyn Env,
    task: &Json,
    opts: &EnvLoopOptions,
) -> Result<(f64, Map<String, Json>)> {
    let first = env.reset(task).await?;
    let system = opts.system_prompt.iter();
    let mut messages: Vec<Message> = system.map(|s| Message::text(Role::System, s)).collect();
    messages.push(first.into_message()?);
    let (mut reward, mut info) = (0.0, Map::new());
    for _ in 0..opts.max_turns {
        let request = ChatRequest {
            messages: messages.clone(),
            sampling: opts.sampling.clone(),
            n: 1,
            template_kwargs: opts.template_kwargs.clone(),
            ..ChatRequest::default()
        };
        let answer = service.turn(session, "call_", request, None).await;
        let answer = answer.map_err(|e| AgentError::Model(e.to_string()))?;
        let reply = answer.choices[0].content.clone().unwrap_or_default();
        let step = env.step(&reply).await?;
        reward += step.reward;
        info = step.info;
        // The reply goes back exactly as answered, so the next rendering extends the segment.
        messages.push(Message::text(Role::Assistant, reply));
        if step.terminated || step.truncated {
            break;
        }
        messages.push(step.observation.into_message()?);
    }
    Ok((reward, info))
}

/// The built-in environments, by name: Rust ones run in-process, `math` is Python (PyPI's
/// math-verify checks answers, docs/agents.md) and runs through moult's Python runner.
pub const BUILTIN: [&str; 2] = ["repeat", "math"];

/// A built-in Rust environment by name.
pub fn builtin(name: &str) -> Result<Box<dyn Env>> {
    match name {
        "repeat" => Ok(Box::new(Repeat::default())),
        other => Err(AgentError::Config(format!(
            "unknown built-in env `{other}`: available: {}",
            BUILTIN.join(", ")
        ))),
    }
}

/// `repeat`: the task names a word (`{"word": "..."}`); the model is asked to say it, and gets
/// reward 1 and the episode ends when a reply contains it (at most `tries`, default 3, replies).
#[derive(Debug, Default)]
pub struct Repeat {
    word: String,
    tries: usize,
    left: usize,
}

impl Env for Repeat {
    fn reset<'a>(&'a mut self, task: &'a Json) -> BoxFuture<'a, Result<Observation>> {
        Box::pin(async move {
            let word = task.get("word").and_then(Json::as_str);
            let missing = || AgentError::Env("repeat: the task needs a string `word`".into());
            self.word = word.ok_or_else(missing)?.to_string();
            self.tries = task.get("tries").and_then(Json::as_u64).unwrap_or(3) as usize;
            self.left = self.tries;
            Ok(format!("Say the word {}.", self.word).into())
        })
    }

    fn step<'a>(&'a mut self, action: &'a str) -> BoxFuture<'a, Result<StepResult>> {
        Box::pin(async move {
            self.left = self.left.saturating_sub(1);
            let said = action.contains(&self.word);
            let info = Map::from_iter([("tries".into(), Json::from(self.tries - self.left))]);
            Ok(StepResult {
                observation: format!("No. Say the word {}.", self.word).into(),
                reward: if said { 1.0 } else { 0.0 },
                terminated: said,
                truncated: !said && self.left == 0,
                info,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn observations_are_text_or_text_and_images() {
        let text: Observation = serde_json::from_value(json!("Look.")).unwrap();
        assert_eq!(
            text.into_message().unwrap(),
            Message::text(Role::User, "Look.")
        );
        let png = "iVBORw0KGgo="; // base64 of the PNG signature: any bytes do here
        let parts: Observation = serde_json::from_value(json!([
            {"type": "text", "text": "What is "},
            {"type": "image", "media_type": "image/png", "data": png},
            {"type": "text", "text": "?"}
        ]))
        .unwrap();
        let m = parts.into_message().unwrap();
        assert_eq!(m.content.as_deref(), Some("What is ?"));
        assert_eq!(m.images().count(), 1);
        assert!(m.images().next().unwrap().data_url.ends_with(png));
        let bad: Observation = serde_json::from_value(json!([
            {"type": "image", "media_type": "image/gif", "data": png}
        ]))
        .unwrap();
        let e = bad.into_message().unwrap_err().to_string();
        assert!(
            e.contains("observation part 0") && e.contains("image/gif"),
            "{e}"
        );
    }

    #[tokio::test]
    async fn repeat_rewards_the_word_and_ends() {
        let mut env = Repeat::default();
        let obs = env
            .reset(&serde_json::json!({"word": "apple", "tries": 2}))
            .await
            .unwrap();
        assert_eq!(obs, Observation::Text("Say the word apple.".into()));
        let miss = env.step("pear").await.unwrap();
        assert_eq!(
            (miss.reward, miss.terminated, miss.truncated),
            (0.0, false, false)
        );
        let hit = env.step("an apple!").await.unwrap();
        assert_eq!((hit.reward, hit.terminated), (1.0, true));
        assert!(env.reset(&serde_json::json!({})).await.is_err());
    }
}
