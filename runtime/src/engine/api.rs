//! The JSON shapes of the engine API (docs/engine.md, vLLM's `/inference/v1/generate` and weight
//! transfer endpoints), and the checks that turn a request into a validated job.
//!
//! Unknown fields are refused with their name: a misspelt `max_token` silently ignored would
//! corrupt a training run, so the generate request and its `sampling_params` accept exactly the
//! fields listed here.

use serde::{Deserialize, Serialize};

use super::sampling::SamplingParams;
use crate::serve::ApiError;

/// A media item of a prompt, as vLLM's token-in `/inference/v1/generate` takes them beside the
/// token ids (`content_parts`): `{"type": "image_url", "url": "data:image/png;base64,..."}`, one
/// per image in prompt order, whose placeholder tokens the ids already hold (docs/vision.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub url: String,
}

impl ContentPart {
    /// An image by its data URL.
    pub fn image(data_url: &str) -> Self {
        Self {
            kind: "image_url".into(),
            url: data_url.into(),
        }
    }
}

/// Why a generation ended: `finish_reason` in a response, and the label of vLLM's
/// `request_success` metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// `POST /inference/v1/generate`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    pub request_id: Option<String>,
    pub token_ids: Vec<i64>,
    #[serde(default)]
    pub sampling_params: SamplingParamsJson,
    #[serde(default)]
    pub stream: bool,
    /// The served model's name (or none) for the model itself, or the name of a LoRA adapter
    /// the engine serves (`/v1/load_lora_adapter`), as vLLM takes it (docs/lora.md).
    pub model: Option<String>,
    /// The prompt's images, in prompt order (vLLM's raw multimodal input):
    /// `{"type": "image_url", "url": "data:image/png;base64,..."}`; `token_ids` already hold
    /// each image's placeholders (docs/vision.md, "Images to the engine").
    pub content_parts: Option<Vec<ContentPart>>,
}

/// The `sampling_params` object, as sent.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingParamsJson {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    /// Number of top alternatives per token; `0` (or absent) reports the sampled token only.
    pub logprobs: Option<i64>,
    #[serde(default)]
    pub stop_token_ids: Vec<i64>,
    pub seed: Option<u64>,
    #[serde(default)]
    pub ignore_eos: bool,
    pub min_tokens: Option<i64>,
    pub n: Option<i64>,
    pub routed_experts_prompt_start: Option<i64>,
    /// Logprobs of the prompt's own tokens (vLLM's `prompt_logprobs`): `0` gives each prompt
    /// token's logprob (with its rank) under the raw distribution, temperature 1; `k` adds the
    /// `k` most likely tokens of each position. Non-streaming requests only.
    pub prompt_logprobs: Option<i64>,
    /// Accepted and ignored: the engine never detokenizes.
    pub detokenize: Option<bool>,
    pub skip_special_tokens: Option<bool>,
}

/// The most top alternatives a request may ask for, as vLLM's default `max_logprobs`.
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// A request that passed every check.
#[derive(Debug)]
pub struct ValidRequest {
    pub request_id: Option<String>,
    pub prompt: Vec<i64>,
    pub params: SamplingParams,
    pub stream: bool,
    pub routed_experts_prompt_start: usize,
    /// Checked against the model by the HTTP layer, which decodes them.
    pub content_parts: Vec<ContentPart>,
    /// Resolved by the HTTP layer against the served name and the adapters.
    pub model: Option<String>,
}

fn bad(param: &str, message: String) -> ApiError {
    ApiError::bad_request(message).with_param(param)
}

impl GenerateRequest {
    /// Checks every field against the model; errors name the field and what is accepted.
    pub fn validate(
        self,
        vocab_size: usize,
        max_model_len: usize,
    ) -> Result<ValidRequest, ApiError> {
        let p = self.sampling_params;
        if self.token_ids.is_empty() {
            return Err(bad("token_ids", "token_ids must not be empty".into()));
        }
        if let Some((i, &t)) = self
            .token_ids
            .iter()
            .enumerate()
            .find(|(_, &t)| t < 0 || t as usize >= vocab_size)
        {
            return Err(bad(
                "token_ids",
                format!("token_ids[{i}] = {t} is outside the vocabulary: ids must be in [0, {vocab_size})"),
            ));
        }
        if let Some(&t) = p
            .stop_token_ids
            .iter()
            .find(|&&t| t < 0 || t as usize >= vocab_size)
        {
            return Err(bad(
                "sampling_params.stop_token_ids",
                format!(
                    "stop token id {t} is outside the vocabulary: ids must be in [0, {vocab_size})"
                ),
            ));
        }
        let temperature = p.temperature.unwrap_or(1.0);
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(bad(
                "sampling_params.temperature",
                format!(
                    "temperature must be a non-negative number (0 = greedy), got {temperature}"
                ),
            ));
        }
        let top_p = p.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(bad(
                "sampling_params.top_p",
                format!("top_p must be in (0, 1], got {top_p}"),
            ));
        }
        let top_k = match p.top_k {
            None | Some(0) | Some(-1) => None,
            Some(k) if k > 0 => Some(k as usize),
            Some(k) => {
                return Err(bad(
                    "sampling_params.top_k",
                    format!("top_k must be -1 or 0 (disabled) or a positive integer, got {k}"),
                ))
            }
        };
        let top_logprobs = match p.logprobs {
            None => 0,
            Some(n) if (0..=MAX_TOP_LOGPROBS).contains(&n) => n as usize,
            Some(n) => {
                return Err(bad(
                    "sampling_params.logprobs",
                    format!("logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                ))
            }
        };
        if let Some(n) = p.n.filter(|&n| n != 1) {
            return Err(bad(
                "sampling_params.n",
                format!(
                    "n must be 1 (send one request per sample; each gets its own seed), got {n}"
                ),
            ));
        }
        let prompt_logprobs = match p.prompt_logprobs {
            None => None,
            Some(_) if self.stream => return Err(bad(
                "sampling_params.prompt_logprobs",
                "prompt_logprobs come with the whole response: send the request with stream: false"
                    .into(),
            )),
            Some(n) if (0..=MAX_TOP_LOGPROBS).contains(&n) => Some(n as usize),
            Some(n) => {
                return Err(bad(
                    "sampling_params.prompt_logprobs",
                    format!("prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
                ))
            }
        };
        let prompt_len = self.token_ids.len();
        if prompt_len >= max_model_len {
            return Err(bad(
                "token_ids",
                format!(
                    "This model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len}, leaving no room to generate"
                ),
            ));
        }
        let max_tokens = match p.max_tokens {
            None => max_model_len - prompt_len,
            Some(m) if m >= 1 => m as usize,
            Some(m) => {
                return Err(bad(
                    "sampling_params.max_tokens",
                    format!("max_tokens must be at least 1, got {m}"),
                ))
            }
        };
        if prompt_len + max_tokens > max_model_len {
            return Err(bad(
                "sampling_params.max_tokens",
                format!(
                    "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt_len} in the prompt, {max_tokens} for max_tokens)",
                    prompt_len + max_tokens
                ),
            ));
        }
        let min_tokens = match p.min_tokens {
            None => 0,
            Some(m) if m >= 0 && m as usize <= max_tokens => m as usize,
            Some(m) => {
                return Err(bad(
                    "sampling_params.min_tokens",
                    format!("min_tokens must be between 0 and max_tokens ({max_tokens}), got {m}"),
                ))
            }
        };
        // With images the prompt grows by their placeholders: the engine checks the bound again
        // once it has expanded them.
        let images = self.content_parts.as_ref().is_some_and(|p| !p.is_empty());
        let routed_experts_prompt_start = match p.routed_experts_prompt_start {
            None => 0,
            Some(s) if s >= 0 && ((s as usize) < prompt_len || images) => s as usize,
            Some(s) => {
                return Err(bad(
                    "sampling_params.routed_experts_prompt_start",
                    format!("routed_experts_prompt_start must be in [0, {prompt_len}) (the prompt length), got {s}"),
                ))
            }
        };
        if let Some(id) = &self.request_id {
            if id.is_empty() || id.len() > 256 {
                return Err(bad(
                    "request_id",
                    "request_id must be 1 to 256 characters".into(),
                ));
            }
        }
        Ok(ValidRequest {
            request_id: self.request_id,
            prompt: self.token_ids,
            params: SamplingParams {
                max_tokens,
                temperature,
                top_p,
                top_k,
                seed: p.seed,
                stop_token_ids: p.stop_token_ids,
                ignore_eos: p.ignore_eos,
                min_tokens,
                top_logprobs,
                prompt_logprobs,
            },
            stream: self.stream,
            routed_experts_prompt_start,
            content_parts: self.content_parts.unwrap_or_default(),
            model: self.model,
        })
    }
}

/// One entry of `logprobs.content`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TokenLogprob {
    pub token_id: i64,
    pub logprob: f32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TopLogprob {
    pub token_id: i64,
    pub logprob: f32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Logprobs {
    pub content: Vec<TokenLogprob>,
}

/// Output tokens `[start, end)` (indices into this choice's `token_ids`, counted from the first
/// generated token) were sampled under weight version `version`.
///
/// vLLM reports versions as strings: the number moult set at the last update, or `"default"`
/// for the weights it started with, which are version 0.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct WeightVersionSpan {
    #[serde(deserialize_with = "span_version")]
    pub version: u64,
    pub start: usize,
    pub end: usize,
}

/// A choice of a generate response or of a streamed chunk. Read from the built-in engine, the
/// router and vLLM alike: vLLM sends `null` for `weight_versions` in every chunk but the last,
/// `null` for `logprobs` when none were asked for, and fields moult does not use (`rank`,
/// `stop_reason`, `sampling_mask`, ...), which are ignored.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Choice {
    #[serde(default)]
    pub index: usize,
    pub token_ids: Vec<i64>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub logprobs: Logprobs,
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub routed_experts: Option<String>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub weight_versions: Vec<WeightVersionSpan>,
}

/// `null` (or absent, with `#[serde(default)]`) as the type's default.
fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A span's version, as [`reported_version`] reads it.
fn span_version<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let v = serde_json::Value::deserialize(d)?;
    reported_version(&v).ok_or_else(|| {
        serde::de::Error::custom(format!(
            "weight_versions[].version must be a non-negative integer, a string of one or \"default\", got {v}"
        ))
    })
}

impl Choice {
    /// An empty choice 0, to which tokens are pushed.
    pub fn empty() -> Self {
        Self {
            index: 0,
            token_ids: Vec::new(),
            logprobs: Logprobs::default(),
            finish_reason: None,
            routed_experts: None,
            weight_versions: Vec::new(),
        }
    }

    /// Appends a sampled token, extending the version spans.
    pub fn push_token(&mut self, logprob: TokenLogprob, version: u64) {
        let index = self.token_ids.len();
        match self.weight_versions.last_mut() {
            Some(last) if last.version == version && last.end == index => last.end = index + 1,
            _ => self.weight_versions.push(WeightVersionSpan {
                version,
                start: index,
                end: index + 1,
            }),
        }
        self.token_ids.push(logprob.token_id);
        self.logprobs.content.push(logprob);
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }
}

/// A token's logprob in `prompt_logprobs`, as vLLM reports it (`decoded_token` is `null`: the
/// engine never detokenizes).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct RankedLogprob {
    pub logprob: f32,
    /// 1 for the most likely token of the position.
    #[serde(default)]
    pub rank: Option<u64>,
    #[serde(default)]
    pub decoded_token: Option<String>,
}

/// `prompt_logprobs` of a response: `null` for the first prompt token (nothing predicts it),
/// then for each later one a map from token id to its logprob: the prompt token itself and the
/// most likely tokens asked for.
pub type PromptLogprobs = Vec<Option<std::collections::BTreeMap<i64, RankedLogprob>>>;

/// The non-streaming response, and (with a token delta in `choices[0]`) each streamed chunk.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GenerateResponse {
    pub request_id: String,
    pub choices: Vec<Choice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// `POST /inference/v1/abort_requests`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AbortRequest {
    pub request_ids: Vec<String>,
}

/// `POST /init_weight_transfer_engine`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitWeightTransfer {
    pub init_info: InitInfo,
}

/// Where the trainer's weight stream is. With `nccl_unique_id_b64` it is the NCCL data plane
/// (GPU builds); otherwise the TCP data plane: the engine connects to `master_address:master_port`
/// and announces its rank.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InitInfo {
    pub master_address: Option<String>,
    pub master_port: Option<u16>,
    #[serde(default)]
    pub rank_offset: u32,
    pub world_size: Option<u32>,
    pub nccl_unique_id_b64: Option<String>,
    pub packed_buffer_size_bytes: Option<u64>,
}

/// `POST /update_weights`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateWeights {
    pub update_info: UpdateInfo,
}

/// The tensors of one bucket, in the order their bytes follow on the data plane.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct UpdateInfo {
    pub names: Vec<String>,
    pub dtype_names: Vec<String>,
    pub shapes: Vec<Vec<i64>>,
    /// Accepted for vLLM compatibility: the byte stream is always packed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packed: Option<bool>,
}

/// `POST /finish_weight_update`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FinishWeightUpdate {
    /// A number, or a string of one (vLLM sends its versions as strings).
    #[serde(deserialize_with = "version_number_or_string")]
    pub weight_version: u64,
}

/// `POST /collective_rpc`: vLLM's call of a method on every worker. The built-in engine has one:
/// `reload_weights` with `kwargs.weights_path`, a weight update from a folder.
#[derive(Debug, Deserialize)]
pub struct CollectiveRpc {
    pub method: String,
    #[serde(default)]
    pub kwargs: serde_json::Map<String, serde_json::Value>,
}

/// `POST /update_weight_version`: the version of the weights now loaded.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateWeightVersion {
    #[serde(deserialize_with = "new_version_number_or_string")]
    pub new_version: u64,
}

fn new_version_number_or_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    NumberOrText::deserialize(d)?.version("new_version")
}

fn version_number_or_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    NumberOrText::deserialize(d)?.version("weight_version")
}

/// A weight version as an engine reports it (`/weight_info`'s `weight_version`, a span's
/// `version`): a number, a string of one, or vLLM's `"default"` for the weights it started with
/// (version 0). `None` for anything else.
pub fn reported_version(v: &serde_json::Value) -> Option<u64> {
    match v {
        serde_json::Value::String(s) if s == "default" => Some(0),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        other => other.as_u64(),
    }
}

/// A policy version as JSON: a number, or a string of one (vLLM's versions are strings).
#[derive(Deserialize)]
#[serde(untagged)]
enum NumberOrText {
    Number(u64),
    Text(String),
}

impl NumberOrText {
    fn version<E: serde::de::Error>(self, field: &str) -> Result<u64, E> {
        match self {
            NumberOrText::Number(n) => Ok(n),
            NumberOrText::Text(s) => s.trim().parse().map_err(|_| {
                E::custom(format!(
                    "{field} must be a non-negative integer (or a string of one), got {s:?}"
                ))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(json: serde_json::Value) -> Result<ValidRequest, String> {
        let r: GenerateRequest = serde_json::from_value(json).map_err(|e| e.to_string())?;
        r.validate(100, 64)
            .map_err(|e| format!("{} {}", e.param.clone().unwrap_or_default(), e.message))
    }

    #[test]
    fn vllm_responses_parse_with_string_versions_and_null_fields() {
        // As vLLM 0.32 answers (recorded in tests/fixtures/vllm_cpu/): the final chunk of a stream that
        // crossed a weight update, and an intermediate chunk.
        let last: GenerateResponse = serde_json::from_value(serde_json::json!({
            "request_id": "generate-tokens-abc", "usage": null, "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": null,
                "token_ids": [7, 8], "routed_experts": null, "sampling_mask": null,
                "weight_versions": [{"version": "default", "start": 0, "end": 275},
                                    {"version": "1", "start": 275, "end": 277}],
                "logprobs": {"content": [
                    {"token_id": 7, "logprob": -1.5, "rank": 3,
                     "top_logprobs": [{"token_id": 7, "logprob": -1.5, "rank": 3}]},
                    {"token_id": 8, "logprob": -0.5, "rank": 1, "top_logprobs": []}]}}]
        }))
        .unwrap();
        let c = &last.choices[0];
        assert_eq!(
            c.weight_versions,
            [
                WeightVersionSpan {
                    version: 0,
                    start: 0,
                    end: 275
                },
                WeightVersionSpan {
                    version: 1,
                    start: 275,
                    end: 277
                }
            ]
        );
        assert_eq!(c.logprobs.content[0].top_logprobs[0].token_id, 7);
        let middle: GenerateResponse = serde_json::from_value(serde_json::json!({
            "request_id": "generate-tokens-abc",
            "choices": [{"index": 0, "finish_reason": null, "token_ids": [7],
                "weight_versions": null, "logprobs": null}]
        }))
        .unwrap();
        assert!(middle.choices[0].weight_versions.is_empty());
        assert!(middle.choices[0].logprobs.content.is_empty());
        let bad = serde_json::from_value::<GenerateResponse>(serde_json::json!({
            "request_id": "x",
            "choices": [{"token_ids": [], "finish_reason": null,
                "weight_versions": [{"version": "v2", "start": 0, "end": 1}]}]
        }));
        assert!(bad
            .unwrap_err()
            .to_string()
            .contains("weight_versions[].version"));
    }

    #[test]
    fn reported_versions_read_vllms_strings() {
        use serde_json::json;
        assert_eq!(reported_version(&json!("default")), Some(0));
        assert_eq!(reported_version(&json!("12")), Some(12));
        assert_eq!(reported_version(&json!(12)), Some(12));
        assert_eq!(reported_version(&json!("v12")), None);
        assert_eq!(reported_version(&json!(null)), None);
    }

    #[test]
    fn weight_versions_come_as_numbers_or_strings() {
        let n: FinishWeightUpdate =
            serde_json::from_value(serde_json::json!({"weight_version": 7})).unwrap();
        let s: FinishWeightUpdate =
            serde_json::from_value(serde_json::json!({"weight_version": "7"})).unwrap();
        assert_eq!((n.weight_version, s.weight_version), (7, 7));
        let bad = serde_json::from_value::<FinishWeightUpdate>(
            serde_json::json!({"weight_version": "v7"}),
        );
        assert!(bad.unwrap_err().to_string().contains("weight_version"));
    }

    #[test]
    fn defaults_fill_the_context() {
        let v = req(serde_json::json!({"token_ids": [1, 2, 3]})).unwrap();
        assert_eq!(v.params.max_tokens, 61);
        assert_eq!(v.params.temperature, 1.0);
        assert_eq!(v.params.top_k, None);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (serde_json::json!({"token_ids": []}), "token_ids"),
            (
                serde_json::json!({"token_ids": [1, 100]}),
                "token_ids[1] = 100",
            ),
            (
                serde_json::json!({"token_ids": [1], "sampling_params": {"temperature": -1.0}}),
                "sampling_params.temperature",
            ),
            (
                serde_json::json!({"token_ids": [1], "sampling_params": {"top_p": 0.0}}),
                "sampling_params.top_p",
            ),
            (
                serde_json::json!({"token_ids": [1], "sampling_params": {"top_k": -3}}),
                "sampling_params.top_k",
            ),
            (
                serde_json::json!({"token_ids": [1], "sampling_params": {"max_tokens": 64}}),
                "maximum context length is 64",
            ),
            (
                serde_json::json!({"token_ids": [1], "sampling_params": {"n": 2}}),
                "sampling_params.n",
            ),
            (
                serde_json::json!({"token_ids": [1], "sampling_params": {"logprobs": 21}}),
                "sampling_params.logprobs",
            ),
            (
                serde_json::json!({"token_ids": [1], "sampling_params": {"max_token": 3}}),
                "unknown field `max_token`",
            ),
            (
                serde_json::json!({"token_ids": [1], "prompt": "hi"}),
                "unknown field `prompt`",
            ),
            (
                serde_json::json!({"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 2}}),
                "routed_experts_prompt_start",
            ),
        ];
        for (json, needle) in cases {
            let err = req(json.clone()).unwrap_err();
            assert!(err.contains(needle), "{json}: {err}");
        }
    }
}
