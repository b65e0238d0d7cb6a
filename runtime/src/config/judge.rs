//! The judge's settings (`spec.judge`) and its prompt template: `{response}`, `{task}` and
//! `{task.FIELD}` placeholders, checked against the dataset before a run starts and filled for
//! each episode by the judge stage (docs/algorithms.md, "LLM as judge").

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

/// One placeholder of a judge prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placeholder {
    Response,
    Task,
    TaskField(String),
}

/// The placeholders of `template` with their byte ranges, in order. A placeholder is `{response}`,
/// `{task}` or `{task.FIELD}` (FIELD of letters, digits, `_` and `-`); any other brace is text.
fn placeholders(template: &str) -> Vec<(std::ops::Range<usize>, Placeholder)> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(open) = template[from..].find('{').map(|i| from + i) {
        let Some(close) = template[open..].find('}').map(|i| open + i) else {
            break;
        };
        let inner = &template[open + 1..close];
        let field_ok = |f: &str| {
            !f.is_empty()
                && f.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        };
        let placeholder = match inner {
            "response" => Some(Placeholder::Response),
            "task" => Some(Placeholder::Task),
            _ => inner
                .strip_prefix("task.")
                .filter(|f| field_ok(f))
                .map(|f| Placeholder::TaskField(f.to_string())),
        };
        match placeholder {
            Some(p) => {
                found.push((open..close + 1, p));
                from = close + 1;
            }
            // Not a placeholder (e.g. a JSON example in the prompt): go on after this brace.
            None => from = open + 1,
        }
    }
    found
}

/// The task fields a prompt reads (`{task.FIELD}`), to check the dataset before a run starts.
pub fn task_fields(template: &str) -> Vec<String> {
    placeholders(template)
        .into_iter()
        .filter_map(|(_, p)| match p {
            Placeholder::TaskField(f) => Some(f),
            _ => None,
        })
        .collect()
}

/// The judge's prompt for one episode: `{task}` → the task as JSON, `{task.FIELD}` → that
/// top-level field (a string as it is, anything else as JSON), `{response}` → the reply. One
/// pass over the template, so text the reply brings in (say, a literal `{task}`) stays as it is.
/// Refused: a `{task.FIELD}` the task lacks (the message names the field).
pub fn fill_prompt(template: &str, task: &Json, response: &str) -> Result<String, MissingField> {
    let mut out = String::with_capacity(template.len() + response.len());
    let mut at = 0;
    for (range, p) in placeholders(template) {
        out.push_str(&template[at..range.start]);
        match p {
            Placeholder::Response => out.push_str(response),
            Placeholder::Task => out.push_str(&task.to_string()),
            Placeholder::TaskField(f) => match task.get(&f) {
                Some(Json::String(s)) => out.push_str(s),
                Some(v) => out.push_str(&v.to_string()),
                None => {
                    return Err(MissingField {
                        field: f,
                        task: task.clone(),
                    })
                }
            },
        }
        at = range.end;
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
