//! The judge's settings (`spec.judge`) and its prompt template: `{response}`, `{task}` and
//! `{task.FIELD}` placeholders, checked against the dataset before a run starts and filled for
//! each episode by the judge stage (docs/algorithms.md, "LLM as judge").

use std::sync::LazyLock;

use regex::Regex;
use serde_json::Value as Json;

/// The judge settings of a run (from `spec.judge`).
#[derive(Debug, Clone, PartialEq)]
pub struct JudgeOptions {
    pub model_dir: std::path::PathBuf,
    pub prompt: String,
    pub weight: f64,
    pub agent_weight: f64,
    pub max_tokens: usize,
}

/// A `{task.FIELD}` of the prompt that the task lacks.
#[derive(Debug, thiserror::Error)]
#[error("{{task.{field}}}: the task has no field `{field}`: {task}")]
pub struct MissingField {
    pub field: String,
    pub task: Json,
}

/// A placeholder of a judge prompt: `{response}`, `{task}` or `{task.FIELD}` (FIELD of letters,
/// digits, `_` and `-`, captured second); any other brace is text.
static PLACEHOLDER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\{(response|task|task\.([A-Za-z0-9_-]+))\}").expect("the pattern is valid")
});

/// The task fields a prompt reads (`{task.FIELD}`), to check the dataset before a run starts.
pub fn task_fields(template: &str) -> Vec<String> {
    let fields = PLACEHOLDER.captures_iter(template);
    fields
        .filter_map(|c| Some(c.get(2)?.as_str().to_string()))
        .collect()
}

/// The judge's prompt for one episode: `{task}` → the task as JSON, `{task.FIELD}` → that
/// top-level field (a string as it is, anything else as JSON), `{response}` → the reply. One
/// pass over the template, so text the reply brings in (say, a literal `{task}`) stays as it is.
/// Refused: a `{task.FIELD}` the task lacks (the message names the field).
pub fn fill_prompt(template: &str, task: &Json, response: &str) -> Result<String, MissingField> {
    let mut out = String::with_capacity(template.len() + response.len());
    let mut at = 0;
    for c in PLACEHOLDER.captures_iter(template) {
        let whole = c.get(0).expect("a match has its whole");
        out.push_str(&template[at..whole.start()]);
        match (&c[1], c.get(2).map(|f| f.as_str())) {
            ("response", _) => out.push_str(response),
            (_, None) => out.push_str(&task.to_string()),
            (_, Some(field)) => match task.get(field) {
                Some(Json::String(s)) => out.push_str(s),
                Some(v) => out.push_str(&v.to_string()),
                None => {
                    let (field, task) = (field.to_string(), task.clone());
                    return Err(MissingField { field, task });
                }
            },
        }
        at = whole.end();
    }
    out.push_str(&template[at..]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompts_fill_task_fields_task_json_and_the_response() {
        let task = json!({"digit": 3, "name": "succ", "numbers": [3]});
        let p = fill_prompt(
            "Digit: {task.digit}. Name: {task.name}. Numbers: {task.numbers}. Task: {task}. Answer: {response}.",
            &task,
            "4",
        )
        .unwrap();
        assert_eq!(
            p,
            r#"Digit: 3. Name: succ. Numbers: [3]. Task: {"digit":3,"name":"succ","numbers":[3]}. Answer: 4."#
        );
    }

    #[test]
    fn a_reply_with_placeholders_is_not_expanded_and_other_braces_stay() {
        let task = json!({"secret": "x"});
        let p = fill_prompt(
            r#"Reply as {"score": N}. {response} {task.secret} {unknown} {task.}"#,
            &task,
            "{task.secret} {task}",
        )
        .unwrap();
        assert_eq!(
            p,
            r#"Reply as {"score": N}. {task.secret} {task} x {unknown} {task.}"#
        );
    }

    #[test]
    fn a_missing_task_field_is_refused_by_name() {
        let err = fill_prompt("{task.digit}: {response}", &json!({"n": 1}), "4").unwrap_err();
        assert_eq!(err.field, "digit");
        assert!(err.to_string().contains("no field `digit`"), "{err}");
        assert_eq!(
            task_fields("{task.digit} {task} {task.a-b} {response}"),
            ["digit", "a-b"]
        );
    }
}
