//! The engine's generate request (token in) and its validation: any JSON body is either refused
//! with a message naming a field, or becomes a job within the documented bounds.

use proptest::prelude::*;
use serde_json::{json, Map, Value as Json};

use crate::{drive, Budget, Row};
use moult_runtime::engine::api::{GenerateRequest, MAX_TOP_LOGPROBS};

const VOCAB: usize = 100;
const MAX_MODEL_LEN: usize = 64;

/// Numbers near every bound the validation has, and far outside them.
pub fn number() -> impl Strategy<Value = Json> {
    prop_oneof![
        (-3i64..70).prop_map(Json::from),
        prop::sample::select(vec![
            i64::MIN,
            i64::MAX,
            -1,
            0,
            1,
            63,
            64,
            65,
            99,
            100,
            20,
            21,
            256,
            1 << 53
        ])
        .prop_map(Json::from),
        any::<u64>().prop_map(Json::from),
        prop::sample::select(vec![
            0.0,
            -0.0,
            1e-320,
            1e-300,
            1e-9,
            0.5,
            1.0,
            1.0000001,
            2.0,
            1e300,
            -1.0,
            f64::MAX,
            f64::MIN_POSITIVE
        ])
        .prop_map(Json::from),
        any::<f64>().prop_map(Json::from),
    ]
}

/// Any JSON scalar or small container, biased to numbers.
pub fn value() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        4 => number(),
        1 => Just(Json::Null),
        1 => any::<bool>().prop_map(Json::from),
        1 => ".{0,300}".prop_map(Json::from),
        1 => "[0-9 ]{1,4}".prop_map(Json::from),
    ];
    leaf.prop_recursive(2, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Json::from),
            prop::collection::btree_map("[a-z_]{1,12}", inner, 0..3)
                .prop_map(|m| Json::Object(m.into_iter().collect())),
        ]
    })
}

fn token_ids() -> impl Strategy<Value = Json> {
    prop_oneof![
        4 => prop::collection::vec(prop_oneof![9 => 0i64..100, 1 => any::<i64>()], 0..70)
            .prop_map(Json::from),
        1 => value(),
    ]
}

const PARAMS: [&str; 14] = [
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "logprobs",
    "stop_token_ids",
    "seed",
    "ignore_eos",
    "min_tokens",
    "n",
    "routed_experts_prompt_start",
    "detokenize",
    "skip_special_tokens",
    "max_token",
];

fn sampling_params() -> impl Strategy<Value = Json> {
    let field = (prop::sample::select(PARAMS.to_vec()), value());
    prop_oneof![
        8 => prop::collection::vec(field, 0..8).prop_map(|fields| {
            let mut m = Map::new();
            for (k, v) in fields {
                let v = if k == "stop_token_ids" && v.is_number() { json!([v]) } else { v };
                m.insert(k.to_string(), v);
            }
            Json::Object(m)
        }),
        1 => value(),
    ]
}

fn request() -> impl Strategy<Value = Json> {
    (
        token_ids(),
        prop::option::of(sampling_params()),
        prop::option::of(value()),
        prop::option::of(prop_oneof![".{0,300}".prop_map(Json::from), value()]),
        prop::option::of(("[a-z]{1,8}", value())),
    )
        .prop_map(|(ids, params, stream, id, extra)| {
            let mut m = Map::new();
            m.insert("token_ids".into(), ids);
            if let Some(p) = params {
                m.insert("sampling_params".into(), p);
            }
            if let Some(s) = stream {
                m.insert("stream".into(), s);
            }
            if let Some(id) = id {
                m.insert("request_id".into(), id);
            }
            if let Some((k, v)) = extra {
                m.insert(k, v);
            }
            Json::Object(m)
        })
}

fn check(body: &[u8]) -> Result<(), TestCaseError> {
    let Ok(req) = serde_json::from_slice::<GenerateRequest>(body) else {
        return Ok(());
    };
    let stop_ids = req.sampling_params.stop_token_ids.clone();
    let prompt_len = req.token_ids.len();
    match req.validate(VOCAB, MAX_MODEL_LEN) {
        Err(e) => {
            prop_assert!(e.status.as_u16() == 400, "{e}");
            prop_assert!(e.param.is_some(), "an error names its field: {e}");
            prop_assert!(!e.message.is_empty());
        }
        Ok(v) => {
            let p = &v.params;
            prop_assert!(!v.prompt.is_empty() && v.prompt.len() == prompt_len);
            prop_assert!(v.prompt.iter().all(|&t| (0..VOCAB as i64).contains(&t)));
            prop_assert!(stop_ids.iter().all(|&t| (0..VOCAB as i64).contains(&t)));
            prop_assert!(p.temperature.is_finite() && p.temperature >= 0.0);
            prop_assert!(p.top_p > 0.0 && p.top_p <= 1.0);
            prop_assert!(p.top_k.is_none_or(|k| k >= 1));
            prop_assert!(p.top_logprobs as i64 <= MAX_TOP_LOGPROBS);
            prop_assert!(p.max_tokens >= 1 && prompt_len + p.max_tokens <= MAX_MODEL_LEN);
            prop_assert!(p.min_tokens <= p.max_tokens);
            prop_assert!(v.routed_experts_prompt_start < prompt_len);
            if let Some(id) = &v.request_id {
                prop_assert!((1..=256).contains(&id.len()));
            }
        }
    }
    Ok(())
}

/// The body as sent, sometimes with a few bytes overwritten (what the server parses first).
fn body() -> impl Strategy<Value = Vec<u8>> {
    (
        request(),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
    )
        .prop_map(|(json, edits)| {
            let mut bytes = json.to_string().into_bytes();
            for (at, b) in edits {
                let i = at.index(bytes.len());
                bytes[i] = b;
            }
            bytes
        })
}

pub fn target(budget: Budget) -> Row {
    drive("generate_request", budget, 3000, body(), |b| check(&b))
}
