//! Sampling with arbitrary logits (NaN, ±inf, huge and tiny values) under any parameters the
//! request validation accepts: never a panic; the token is in the vocabulary; its logprob (and
//! every reported alternative's) is finite and at most 0, or the row is refused; greedy takes a
//! maximum; and the trainer-side recomputation (`processed_logprob`) agrees with the engine's.

use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::{drive, Budget, Row};
use moult_runtime::engine::sampling::{processed_logprob, sample, SamplingParams};

fn logit() -> impl Strategy<Value = f32> {
    prop_oneof![
        40 => -20.0f32..20.0,
        4 => prop::sample::select(vec![0.0f32, -0.0, 1.0, 3.0, 3.0, -2.0]),
        2 => prop::sample::select(vec![
            f32::MAX, f32::MIN, 1e30, -1e30, f32::MIN_POSITIVE, 1e-45, -1e-45, 65504.0, -65504.0
        ]),
        2 => any::<f32>(),
        1 => Just(f32::NAN),
        1 => Just(f32::INFINITY),
        2 => Just(f32::NEG_INFINITY),
    ]
}

/// Rows that are mostly ordinary, some with a few special values, a few made only of them.
fn logits() -> impl Strategy<Value = Vec<f32>> {
    let len = prop_oneof![8 => 1usize..12, 2 => 12usize..80, 1 => Just(300usize)];
    prop_oneof![
        3 => len.clone().prop_flat_map(|n| prop::collection::vec(-20.0f32..20.0, n)),
        6 => len.clone().prop_flat_map(|n| prop::collection::vec(logit(), n)),
        1 => len.prop_flat_map(|n| prop::collection::vec(
            prop::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX]),
            n,
        )),
    ]
}

/// Parameters as `GenerateRequest::validate` can produce them.
fn params(vocab: usize) -> impl Strategy<Value = SamplingParams> {
    let temperature = prop_oneof![
        2 => Just(0.0),
        4 => 0.05f64..3.0,
        2 => prop::sample::select(vec![
            1e-320, 1e-300, 1e-30, 1e-6, 1e-2, 1.0, 2.0, 1e10, 1e300, f64::MAX
        ]),
    ];
    let top_p = prop_oneof![
        4 => Just(1.0),
        3 => 0.01f64..1.0,
        1 => prop::sample::select(vec![1e-300, 1e-9, 0.5, 0.999_999_9, 1.0 - f64::EPSILON]),
    ];
    let top_k = prop_oneof![
        3 => Just(None),
        2 => (1..=vocab + 2).prop_map(Some),
        1 => Just(Some(1)),
    ];
    (temperature, top_p, top_k, 0usize..=20, any::<u64>()).prop_map(
        |(temperature, top_p, top_k, top_logprobs, seed)| SamplingParams {
            temperature,
            top_p,
            top_k,
            top_logprobs,
            seed: Some(seed),
            ..SamplingParams::default()
        },
    )
}

fn case() -> impl Strategy<Value = (Vec<f32>, SamplingParams)> {
    logits().prop_flat_map(|l| {
        let n = l.len();
        (Just(l), params(n))
    })
}

fn check(logits: &[f32], params: &SamplingParams) -> Result<(), TestCaseError> {
    let mut rng = ChaCha8Rng::seed_from_u64(params.seed.unwrap_or(0));
    let vocab = logits.len() as i64;
    let Ok(s) = sample(logits, params, &mut rng) else {
        // Refused: only a row with no distribution to sample from (a NaN or +inf, or no finite
        // logit at all).
        prop_assert!(
            logits.iter().any(|l| l.is_nan() || *l == f32::INFINITY)
                || logits.iter().all(|l| *l == f32::NEG_INFINITY),
            "a row of finite logits was refused"
        );
        return Ok(());
    };
    prop_assert!(
        (0..vocab).contains(&s.token),
        "token {} of {vocab}",
        s.token
    );
    prop_assert!(
        s.logprob.is_finite() && s.logprob <= 1e-3,
        "logprob {} for token {}",
        s.logprob,
        s.token
    );
    prop_assert!(
        logits[s.token as usize] > f32::NEG_INFINITY,
        "sampled a -inf logit"
    );
    prop_assert!(s.top.len() <= params.top_logprobs);
    prop_assert!(params.top_logprobs == 0 || !s.top.is_empty());
    for (t, lp) in &s.top {
        prop_assert!((0..vocab).contains(t));
        prop_assert!(lp.is_finite(), "top logprob {lp}");
        prop_assert!(*lp <= 1e-3);
    }
    prop_assert!(s.top.windows(2).all(|w| w[0].1 >= w[1].1), "top not sorted");
    if params.temperature == 0.0 {
        let best = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        prop_assert_eq!(
            logits[s.token as usize],
            best,
            "greedy did not take a maximum"
        );
    }
    // The trainer-side recomputation agrees where the numbers are well-conditioned.
    let ordinary = logits.iter().all(|l| l.abs() <= 1e4) && params.temperature >= 1e-3;
    if ordinary {
        let again = processed_logprob(logits, s.token, params);
        let tol = 1e-3 + 1e-4 * s.logprob.abs();
        prop_assert!(
            (again - s.logprob).abs() <= tol,
            "processed_logprob {again} vs sampled {}",
            s.logprob
        );
    }
    Ok(())
}

pub fn target(budget: Budget) -> Row {
    drive("sampling", budget, 20_000, case(), |(l, p)| check(&l, &p))
}
