//! Token sampling with the log-probability of the *processed* distribution (vLLM's
//! `--logprobs-mode processed_logprobs`).
//!
//! Processing order, as vLLM's sampler: `z = logits / T` (T = 1 for greedy), top-k keeps the k
//! largest `z` (ties at the k-th value kept), top-p sorts ascending and removes tokens while the
//! ascending cumulative probability is `<= 1 - p` (the most likely token always stays). The
//! sampled token's logprob is `z_a - logsumexp(z_kept)`: its log-probability under exactly the
//! distribution it was drawn from, so importance ratios against the trainer are exact.

use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Validated per-request sampling settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub max_tokens: usize,
    /// 0 means greedy.
    pub temperature: f64,
    pub top_p: f64,
    /// `None`: no top-k.
    pub top_k: Option<usize>,
    pub seed: Option<u64>,
    pub stop_token_ids: Vec<i64>,
    pub ignore_eos: bool,
    pub min_tokens: usize,
    /// How many top alternatives to report per token besides the sampled one.
    pub top_logprobs: usize,
    /// `Some(k)`: report the prompt tokens' logprobs, with the `k` most likely of each position.
    pub prompt_logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            seed: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            top_logprobs: 0,
            prompt_logprobs: None,
        }
    }
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: i64,
    pub logprob: f32,
    /// The most likely tokens of the processed distribution, best first, if asked for.
    pub top: Vec<(i64, f32)>,
}

/// Why a row of logits cannot be sampled: the model's output holds no distribution. The request
/// fails with this reason rather than report a NaN logprob the trainer would learn from.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SampleError {
    #[error("the model's logit for token {token} is {value}: its output is not finite (NaN or +inf), so there is no distribution to sample")]
    NotFinite { token: usize, value: f32 },
    #[error("every logit is -inf (all {0} tokens are masked): there is no token to sample")]
    NothingToSample(usize),
}

/// The largest logit of a row, which must hold no NaN or +inf and at least one finite value
/// (-inf is a token the distribution excludes, such as an EOS masked before `min_tokens`).
fn row_max(logits: &[f32]) -> Result<f32, SampleError> {
    let mut max = f32::NEG_INFINITY;
    for (token, &value) in logits.iter().enumerate() {
        if value.is_nan() || value == f32::INFINITY {
            return Err(SampleError::NotFinite { token, value });
        }
        max = max.max(value);
    }
    if max == f32::NEG_INFINITY {
        return Err(SampleError::NothingToSample(logits.len()));
    }
    Ok(max)
}

/// `(l - max) / T` in f64: at most 0, exactly 0 at the maxima, and never NaN, however large the
/// logits or small the temperature (`l / T` alone overflows to ±inf and `inf - inf` is NaN).
fn scaled(logit: f32, max: f32, temperature: f64) -> f64 {
    (f64::from(logit) - f64::from(max)) / temperature
}

/// The processed distribution of one row: kept token ids, and the log normaliser over them.
struct Processed {
    kept: Vec<usize>,
    log_z: f64,
}

/// Top-k then top-p over the scaled logits `z` (all ≤ 0, some 0).
fn process(z: &[f64], params: &SamplingParams) -> Processed {
    let vocab = z.len();
    let mut kept: Vec<usize> = (0..vocab).collect();
    if let Some(k) = params.top_k.filter(|&k| k < vocab) {
        let mut values: Vec<f64> = z.to_vec();
        let (_, kth, _) = values.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let threshold = *kth;
        kept.retain(|&i| z[i] >= threshold);
    }
    if params.top_p < 1.0 {
        kept.sort_by(|&a, &b| z[a].total_cmp(&z[b]));
        let max = z[*kept.last().expect("top-k keeps at least one token")];
        let weights: Vec<f64> = kept.iter().map(|&i| (z[i] - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut cumulative = 0.0;
        let mut drop = 0;
        for w in &weights[..weights.len() - 1] {
            cumulative += w / total;
            if cumulative <= 1.0 - params.top_p {
                drop += 1;
            } else {
                break;
            }
        }
        kept.drain(..drop);
        kept.sort_unstable();
    }
    let max = kept.iter().map(|&i| z[i]).fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = kept.iter().map(|&i| (z[i] - max).exp()).sum();
    Processed {
        kept,
        log_z: max + sum.ln(),
    }
}

/// The temperature the logits are divided by (greedy reports logprobs at T = 1).
fn divisor(params: &SamplingParams) -> f64 {
    if params.temperature == 0.0 {
        1.0
    } else {
        params.temperature
    }
}

/// The `n` most likely of `candidates` by `z`, best first (ties by id), with their logprobs,
/// leaving out tokens whose logprob is -inf as an f32 (probability 0, or too small to write:
/// JSON has no number for -inf).
fn top_n(
    mut candidates: Vec<usize>,
    z: impl Fn(usize) -> f64,
    logprob: impl Fn(usize) -> f32,
    n: usize,
) -> Vec<(i64, f32)> {
    let n = n.min(candidates.len());
    if n == 0 {
        return Vec::new();
    }
    candidates.select_nth_unstable_by(n - 1, |&a, &b| z(b).total_cmp(&z(a)));
    candidates.truncate(n);
    candidates.sort_by(|&a, &b| z(b).total_cmp(&z(a)).then(a.cmp(&b)));
    candidates
        .into_iter()
        .map(|i| (i as i64, logprob(i)))
        .filter(|(_, lp)| lp.is_finite())
        .collect()
}

/// Samples one token from a row of raw logits; a row with a NaN or +inf, or with every logit
/// -inf, is refused.
pub fn sample(
    logits: &[f32],
    params: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Result<Sampled, SampleError> {
    let max = row_max(logits)?;
    let greedy = params.temperature == 0.0;
    let t = divisor(params);
    let truncated = params.top_k.is_some_and(|k| k < logits.len()) || params.top_p < 1.0;
    if !truncated {
        return Ok(sample_full(
            logits,
            max,
            t,
            greedy,
            params.top_logprobs,
            rng,
        ));
    }
    let z: Vec<f64> = logits.iter().map(|&l| scaled(l, max, t)).collect();
    let p = process(&z, params);
    let token = if greedy {
        // First index among the maxima, as torch.argmax.
        *p.kept
            .iter()
            .reduce(|best, i| if z[*i] > z[*best] { i } else { best })
            .expect("non-empty")
    } else {
        let u: f64 = rng.gen();
        let mut cumulative = 0.0;
        // Only rounding at the very end can run past the last token with weight.
        let mut chosen = *p
            .kept
            .iter()
            .rev()
            .find(|&&i| z[i] > f64::NEG_INFINITY)
            .expect("the maximum is kept");
        for &i in &p.kept {
            cumulative += (z[i] - p.log_z).exp();
            if u < cumulative {
                chosen = i;
                break;
            }
        }
        chosen
    };
    let top = if params.top_logprobs > 0 {
        top_n(
            p.kept.clone(),
            |i| z[i],
            |i| (z[i] - p.log_z) as f32,
            params.top_logprobs,
        )
    } else {
        Vec::new()
    };
    Ok(Sampled {
        token: token as i64,
        logprob: (z[token] - p.log_z) as f32,
        top,
    })
}

/// [`sample`] without top-k/top-p (the usual RL setting): one pass of `exp` over the vocabulary,
/// no index vectors.
fn sample_full(
    logits: &[f32],
    max: f32,
    t: f64,
    greedy: bool,
    top_logprobs: usize,
    rng: &mut ChaCha8Rng,
) -> Sampled {
    let argmax = logits.iter().position(|&l| l == max).expect("the maximum");
    let weights: Vec<f64> = logits.iter().map(|&l| scaled(l, max, t).exp()).collect();
    let total: f64 = weights.iter().sum();
    let log_z = total.ln();
    let logprob = |i: usize| (scaled(logits[i], max, t) - log_z) as f32;
    let token = if greedy {
        argmax
    } else {
        let target = rng.gen::<f64>() * total;
        let mut cumulative = 0.0;
        // Only rounding at the very end can run past the last token with weight.
        let mut chosen = weights.iter().rposition(|&w| w > 0.0).unwrap_or(argmax);
        for (i, w) in weights.iter().enumerate() {
            cumulative += w;
            if target < cumulative {
                chosen = i;
                break;
            }
        }
        chosen
    };
    let top = if top_logprobs > 0 {
        top_n(
            (0..logits.len()).collect(),
            |i| scaled(logits[i], max, t),
            logprob,
            top_logprobs,
        )
    } else {
        Vec::new()
    };
    Sampled {
        token: token as i64,
        logprob: logprob(token),
        top,
    }
}

/// The processed log-probability of `token` under `params`, without sampling: what the
/// trainer-side checks recompute from a full forward. NaN for a row [`sample`] refuses.
pub fn processed_logprob(logits: &[f32], token: i64, params: &SamplingParams) -> f32 {
    let Ok(max) = row_max(logits) else {
        return f32::NAN;
    };
    let t = divisor(params);
    let z: Vec<f64> = logits.iter().map(|&l| scaled(l, max, t)).collect();
    let p = process(&z, params);
    if p.kept.binary_search(&(token as usize)).is_err() {
        return f32::NEG_INFINITY;
    }
    (z[token as usize] - p.log_z) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params(temperature: f64, top_k: Option<usize>, top_p: f64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            ..Default::default()
        }
    }

    /// Straightforward reference: softmax of the processed logits, with tokens outside the
    /// kept set at probability zero.
    fn reference_probs(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
        let t = if p.temperature == 0.0 {
            1.0
        } else {
            p.temperature
        };
        let z: Vec<f64> = logits.iter().map(|&l| l as f64 / t).collect();
        let mut keep = vec![true; z.len()];
        if let Some(k) = p.top_k {
            let mut sorted = z.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let kth = sorted[k.min(z.len()) - 1];
            for (i, v) in z.iter().enumerate() {
                keep[i] &= *v >= kth;
            }
        }
        if p.top_p < 1.0 {
            let mut idx: Vec<usize> = (0..z.len()).filter(|&i| keep[i]).collect();
            idx.sort_by(|&a, &b| z[a].total_cmp(&z[b]));
            let m = z[*idx.last().unwrap()];
            let total: f64 = idx.iter().map(|&i| (z[i] - m).exp()).sum();
            let mut cum = 0.0;
            for &i in &idx[..idx.len() - 1] {
                cum += (z[i] - m).exp() / total;
                if cum <= 1.0 - p.top_p {
                    keep[i] = false;
                } else {
                    break;
                }
            }
        }
        let m = z
            .iter()
            .zip(&keep)
            .filter(|(_, k)| **k)
            .map(|(v, _)| *v)
            .fold(f64::MIN, f64::max);
        let w: Vec<f64> = z
            .iter()
            .zip(&keep)
            .map(|(v, k)| if *k { (v - m).exp() } else { 0.0 })
            .collect();
        let s: f64 = w.iter().sum();
        w.into_iter().map(|x| x / s).collect()
    }

    const LOGITS: [f32; 6] = [1.0, 3.0, 0.5, 3.0, -2.0, 2.0];

    #[test]
    fn logprob_is_that_of_the_processed_distribution() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for p in [
            params(1.0, None, 1.0),
            params(0.7, Some(3), 1.0),
            params(1.3, None, 0.8),
            params(0.5, Some(4), 0.6),
        ] {
            let probs = reference_probs(&LOGITS, &p);
            for _ in 0..50 {
                let s = sample(&LOGITS, &p, &mut rng).unwrap();
                let expected = probs[s.token as usize].ln();
                assert!(
                    probs[s.token as usize] > 0.0,
                    "sampled a removed token under {p:?}"
                );
                assert!(
                    (s.logprob as f64 - expected).abs() < 1e-5,
                    "{p:?}: {} vs {expected}",
                    s.logprob
                );
                assert!((processed_logprob(&LOGITS, s.token, &p) - s.logprob).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn empirical_frequencies_follow_the_processed_distribution() {
        // Truncated (top-k and top-p) and full (the single-pass path) distributions.
        for p in [params(0.9, Some(4), 0.9), params(0.7, None, 1.0)] {
            let probs = reference_probs(&LOGITS, &p);
            let mut rng = ChaCha8Rng::seed_from_u64(1);
            let n = 20_000;
            let mut counts = [0usize; 6];
            for _ in 0..n {
                counts[sample(&LOGITS, &p, &mut rng).unwrap().token as usize] += 1;
            }
            for (i, c) in counts.iter().enumerate() {
                let f = *c as f64 / n as f64;
                assert!(
                    (f - probs[i]).abs() < 0.015,
                    "{p:?} token {i}: frequency {f} vs probability {}",
                    probs[i]
                );
            }
        }
    }

    #[test]
    fn top_k_keeps_ties_and_top_p_keeps_the_best() {
        let p = params(1.0, Some(1), 1.0);
        let probs = reference_probs(&LOGITS, &p);
        assert!((probs[1] - 0.5).abs() < 1e-12 && (probs[3] - 0.5).abs() < 1e-12);
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let s = sample(&LOGITS, &params(1.0, None, 1e-9), &mut rng).unwrap();
        assert!(s.token == 1 || s.token == 3);
        assert_eq!(
            processed_logprob(&LOGITS, 4, &params(1.0, Some(2), 1.0)),
            f32::NEG_INFINITY
        );
    }

    #[test]
    fn greedy_takes_the_first_maximum_with_its_logprob() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let s = sample(&LOGITS, &params(0.0, None, 1.0), &mut rng).unwrap();
        assert_eq!(s.token, 1);
        let expected = reference_probs(&LOGITS, &params(1.0, None, 1.0))[1].ln();
        assert!((s.logprob as f64 - expected).abs() < 1e-6);
    }

    #[test]
    fn same_seed_same_tokens() {
        let p = params(1.0, None, 1.0);
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..32)
                .map(|_| sample(&LOGITS, &p, &mut rng).unwrap().token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }

    #[test]
    fn top_logprobs_are_sorted_and_include_the_best() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let p = SamplingParams {
            top_logprobs: 3,
            ..params(1.0, None, 1.0)
        };
        let s = sample(&LOGITS, &p, &mut rng).unwrap();
        let ids: Vec<i64> = s.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 5]);
        assert!(s.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    /// Found by fuzzing (`runtime/tests/fuzz.rs`, sampling): a temperature of 1e-320 (finite and
    /// positive, so accepted) made `1 / T` infinite and the logprob `0 · inf` = NaN; tiny
    /// temperatures with top-k or top-p overflowed `l / T` to ±inf the same way.
    #[test]
    fn tiny_temperatures_give_finite_logprobs() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let s = sample(&[0.0], &params(1e-320, None, 1.0), &mut rng).unwrap();
        assert_eq!((s.token, s.logprob), (0, 0.0));
        for p in [params(1e-300, None, 1.0), params(1e-300, Some(3), 0.9)] {
            let s = sample(&LOGITS, &p, &mut rng).unwrap();
            // Tokens 1 and 3 tie for the maximum: each has half the mass, the rest none.
            assert!(s.token == 1 || s.token == 3, "{p:?}");
            assert!(
                (s.logprob - 0.5f32.ln()).abs() < 1e-6,
                "{p:?}: {}",
                s.logprob
            );
            assert_eq!(processed_logprob(&LOGITS, s.token, &p), s.logprob);
        }
    }

    /// Found by fuzzing: a NaN logit with top-k panicked the engine thread (no token passed the
    /// NaN threshold, and `expect("non-empty")` fired); without top-k it gave NaN logprobs.
    #[test]
    fn rows_without_a_distribution_are_refused() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for (row, p) in [
            (vec![f32::NAN, 1.0], params(0.0, Some(1), 1.0)),
            (vec![f32::NAN, 1.0], params(1.0, Some(1), 0.5)),
            (vec![1.0, f32::NAN], params(1.0, None, 1.0)),
            (vec![f32::INFINITY, 1.0], params(0.7, None, 1.0)),
        ] {
            let err = sample(&row, &p, &mut rng).unwrap_err();
            assert!(matches!(err, SampleError::NotFinite { .. }), "{row:?}");
            assert!(processed_logprob(&row, 1, &p).is_nan());
        }
        let masked = [f32::NEG_INFINITY; 3];
        assert_eq!(
            sample(&masked, &params(1.0, None, 1.0), &mut rng),
            Err(SampleError::NothingToSample(3))
        );
    }

    /// Found by fuzzing: tokens of probability 0 (a -inf logit, as `min_tokens` masks EOS) were
    /// reported among the top alternatives with a logprob of -inf, which JSON cannot carry.
    #[test]
    fn top_logprobs_leave_out_impossible_tokens() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let row = [f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY, 1.0];
        for p in [params(1.0, None, 1.0), params(1.0, Some(4), 0.999)] {
            let p = SamplingParams {
                top_logprobs: 4,
                ..p
            };
            let s = sample(&row, &p, &mut rng).unwrap();
            let ids: Vec<i64> = s.top.iter().map(|t| t.0).collect();
            assert_eq!(ids, vec![1, 3], "{p:?}");
            assert!(s.top.iter().all(|t| t.1.is_finite()));
        }
        // Probability too small for an f32 logprob (e^-1e300): left out the same way.
        let row = [0.0, 0.0, 8.75];
        let p = SamplingParams {
            top_logprobs: 2,
            ..params(1e-300, None, 1.0)
        };
        let s = sample(&row, &p, &mut rng).unwrap();
        assert_eq!(s.top, vec![(2, 0.0)]);
    }
}
