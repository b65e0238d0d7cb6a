//! The one internal chat request: what both the OpenAI and the Anthropic adapters produce and what
//! the loopback server renders through the chat template (CONVENTIONS: one internal request type,
//! thin protocol adapters onto it).
//!
//! Messages are kept in the shape Hugging Face chat templates read (`role`, `content`,
//! `tool_calls: [{id, type: "function", function: {name, arguments}}]`, `tool_call_id`), with
//! tool-call arguments as JSON objects, as vLLM hands them to templates.

use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value as Json};

use super::template::{ChatTemplate, RenderOptions, TemplateError};

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// A tool call the model made (or, in history, made earlier).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments object (`{}` when the model gave none).
    pub arguments: Json,
}

impl ToolCall {
    /// The call in OpenAI's shape, which chat templates read too, with `arguments` (an object
    /// for templates, its JSON text for OpenAI clients).
    pub fn to_openai(&self, arguments: Json) -> Json {
        let function = json!({"name": self.name, "arguments": arguments});
        json!({"id": self.id, "type": "function", "function": function})
    }
}

/// An image of a message, as the client sent it (docs/vision.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// `data:image/png;base64,...` (or jpeg): what engines receive and segments keep.
    pub data_url: String,
    /// Hex SHA-256 of the image's bytes: its identity across turns and in segments.
    pub sha256: String,
}

impl Image {
    /// The image of a data URL; errors say what is wrong with it (a remote URL, a bad media
    /// type, bad base64).
    pub fn from_data_url(url: &str) -> Result<Self, crate::vision::VisionError> {
        let image = crate::vision::parse_data_url(url)?;
        Ok(Self::from_bytes(&image.media_type, &image.bytes))
    }

    /// The image of base64 `data` of `media_type` (an Anthropic image block's, an Env
    /// observation's).
    pub fn from_base64(media_type: &str, data: &str) -> Result<Self, crate::vision::VisionError> {
        Self::from_data_url(&format!("data:{media_type};base64,{data}"))
    }

    /// The image of encoded bytes of `media_type` (`image/png`, `image/jpeg`).
    pub fn from_bytes(media_type: &str, bytes: &[u8]) -> Self {
        use base64::Engine as _;
        use sha2::Digest as _;
        let digest = sha2::Sha256::digest(bytes);
        let sha256 = digest.iter().map(|b| format!("{b:02x}")).collect();
        let data = base64::engine::general_purpose::STANDARD.encode(bytes);
        Self {
            data_url: format!("data:{media_type};base64,{data}"),
            sha256,
        }
    }

    /// The encoded bytes.
    pub fn bytes(&self) -> Result<Vec<u8>, crate::vision::VisionError> {
        crate::vision::parse_data_url(&self.data_url).map(|i| i.bytes)
    }
}

/// A piece of a message with images, in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Part {
    Text { text: String },
    Image { image: Image },
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    /// Text content (of a message with images: its text parts, joined); `None` for an assistant
    /// message that only calls tools.
    pub content: Option<String>,
    /// A message with images: its text and images in order (the template renders an image
    /// placeholder where each image was). Empty for text-only messages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub parts: Vec<Part>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For `Tool` messages: the call this answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// For `Tool` messages: the tool's name, where the protocol gives it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    /// A message of `role` with nothing in it yet (no content: `None`).
    pub fn new(role: Role) -> Self {
        Self {
            role,
            content: None,
            parts: Vec::new(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        }
    }

    pub fn text(role: Role, content: impl Into<String>) -> Self {
        Self {
            content: Some(content.into()),
            ..Self::new(role)
        }
    }

    /// A message of text and images in order; its `content` is the text parts joined.
    pub fn with_parts(role: Role, parts: Vec<Part>) -> Self {
        let text = |p: &Part| match p {
            Part::Text { text } => Some(text.clone()),
            Part::Image { .. } => None,
        };
        let text: String = parts.iter().filter_map(text).collect();
        let images = parts.iter().any(|p| matches!(p, Part::Image { .. }));
        Self {
            parts: if images { parts } else { Vec::new() },
            ..Self::text(role, text)
        }
    }

    /// The message's images, in order.
    pub fn images(&self) -> impl Iterator<Item = &Image> {
        self.parts.iter().filter_map(|p| match p {
            Part::Image { image } => Some(image),
            Part::Text { .. } => None,
        })
    }

    /// The object a chat template reads. A message with images has its content as a list of
    /// `{"type": "text", "text"}` and `{"type": "image"}` parts, as Hugging Face processors
    /// hand them to vision-language templates.
    pub fn to_template(&self) -> Json {
        let part = |p: &Part| match p {
            Part::Text { text } => json!({"type": "text", "text": text}),
            Part::Image { .. } => json!({"type": "image"}),
        };
        let content = if self.parts.is_empty() {
            Json::from(self.content.clone().unwrap_or_default())
        } else {
            self.parts.iter().map(part).collect()
        };
        let mut m = json!({"role": self.role.as_str(), "content": content});
        if !self.tool_calls.is_empty() {
            let calls = self.tool_calls.iter();
            m["tool_calls"] = calls.map(|c| c.to_openai(c.arguments.clone())).collect();
        }
        for (key, value) in [
            ("tool_call_id", &self.tool_call_id),
            ("name", &self.name),
            ("reasoning_content", &self.reasoning_content),
        ] {
            if let Some(value) = value {
                m[key] = Json::from(value.as_str());
            }
        }
        m
    }
}

/// A function the model may call, as chat templates read tools:
/// `{"type": "function", "function": {name, description, parameters}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// JSON Schema of the arguments (Anthropic calls it `input_schema`).
    #[serde(alias = "input_schema")]
    pub parameters: Json,
}

impl Tool {
    pub fn to_template(&self) -> Json {
        json!({"type": "function", "function": self})
    }
}

/// Sampling settings of a chat request, protocol-neutral.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatSampling {
    /// `None`: up to the context length.
    pub max_tokens: Option<usize>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    /// Stop strings: generation ends before the first occurrence.
    pub stop: Vec<String>,
    /// Top alternatives per token to report (OpenAI `top_logprobs`), when `logprobs` is asked.
    pub logprobs: Option<usize>,
}

/// Sampling settings that replace whatever an episode's agent asks for, in every turn of its
/// session: evaluation episodes run at the evaluation's temperature and token budget
/// (docs/run.md, "Evaluation"), whichever form the agent has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SamplingOverride {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
}

impl SamplingOverride {
    /// `sampling` with the set fields replaced.
    pub fn apply(&self, sampling: &mut ChatSampling) {
        sampling.temperature = self.temperature.or(sampling.temperature);
        sampling.max_tokens = self.max_tokens.or(sampling.max_tokens);
    }
}

/// The internal chat request both protocols map onto.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub tools: Vec<Tool>,
    /// Whether tool calls in the output are parsed (`tool_choice` other than `none`).
    pub parse_tool_calls: bool,
    pub sampling: ChatSampling,
    /// Samples of this turn (OpenAI `n`).
    pub n: usize,
    /// Extra template variables (`chat_template_kwargs`, e.g. `enable_thinking`).
    pub template_kwargs: Map<String, Json>,
}

impl ChatRequest {
    /// The prompt of this request by `template`: its messages, tools and template variables,
    /// ending where the assistant's reply starts.
    pub fn render(&self, template: &ChatTemplate) -> Result<String, TemplateError> {
        let messages = self.messages.iter().map(Message::to_template).collect();
        let tools = self.tools.iter().map(Tool::to_template);
        let opts = RenderOptions {
            tools: (!self.tools.is_empty()).then(|| tools.collect()),
            documents: None,
            add_generation_prompt: true,
            extra: self.template_kwargs.clone(),
        };
        template.render(&Json::Array(messages), &opts)
    }
}

/// Why a chat request is refused: a message naming the field (`param`, as a JSON path).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct InvalidRequest {
    pub param: Option<String>,
    pub message: String,
}

impl InvalidRequest {
    pub fn new(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            param: Some(param.into()),
            message: message.into(),
        }
    }

    /// A refusal of the request body as a whole (no field to name).
    pub fn body(message: impl Into<String>) -> Self {
        Self {
            param: None,
            message: message.into(),
        }
    }
}

/// Checks `temperature` (0 to `max_temperature`, the protocol's bound) and `top_p` ((0, 1]).
pub fn check_sampling(
    temperature: Option<f64>,
    max_temperature: f64,
    top_p: Option<f64>,
) -> Result<(), InvalidRequest> {
    if let Some(t) = temperature.filter(|t| !(0.0..=max_temperature).contains(t)) {
        let message = format!("temperature must be between 0 and {max_temperature}, got {t}");
        return Err(InvalidRequest::new("temperature", message));
    }
    if let Some(p) = top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        let message = format!("top_p must be in (0, 1], got {p}");
        return Err(InvalidRequest::new("top_p", message));
    }
    Ok(())
}

/// Tool-call arguments as sent: none (`{}`), an object, or a JSON string of one (OpenAI sends
/// them so).
pub fn arguments_object(param: &str, value: Option<&Json>) -> Result<Json, InvalidRequest> {
    let invalid = |message: &str| InvalidRequest::new(param, message);
    let text = match value {
        None | Some(Json::Null) => "",
        Some(v @ Json::Object(_)) => return Ok(v.clone()),
        Some(Json::String(text)) => text,
        Some(_) => return Err(invalid("arguments must be a JSON string (or object)")),
    };
    if text.trim().is_empty() {
        return Ok(Json::Object(Map::new()));
    }
    match serde_json::from_str::<Json>(text) {
        Ok(v @ Json::Object(_)) => Ok(v),
        Ok(_) => Err(invalid("tool call arguments must be a JSON object")),
        Err(e) => Err(invalid(&format!(
            "tool call arguments are not valid JSON: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn template_shape_of_a_tool_call_message() {
        let m = Message {
            role: Role::Assistant,
            content: None,
            parts: Vec::new(),
            tool_calls: vec![ToolCall {
                id: "call_1".into(),
                name: "f".into(),
                arguments: json!({"x": 1}),
            }],
            tool_call_id: None,
            name: None,
            reasoning_content: None,
        };
        assert_eq!(
            m.to_template(),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]})
        );
    }

    #[test]
    fn arguments_must_be_an_object() {
        let text = |t: &str| arguments_object("a", Some(&json!(t)));
        assert_eq!(text("").unwrap(), json!({}));
        assert_eq!(text("{\"k\": 2}").unwrap(), json!({"k": 2}));
        assert!(text("[1]").unwrap_err().message.contains("object"));
        assert!(text("{").unwrap_err().message.contains("JSON"));
    }
}
