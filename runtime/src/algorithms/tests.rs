//! Each algorithm against a plain loop over numbers, on random inputs (float64).
// The references index rows and tokens as the formulas do.
#![allow(clippy::needless_range_loop)]

use tch::{Device, Kind, Tensor};

use super::advantages::{distillation, grpo, reinforce_pp, rloo};
use super::correction::{Correction, Level, Mode};
use super::losses::{aggregate, cispo, gspo, kl_k3, ppo_clip, Aggregation};

const B: usize = 5;
const T: usize = 7;

fn rand(shape: &[i64], scale: f64, seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, (Kind::Double, Device::Cpu)) * scale
}

fn rows(t: &Tensor) -> Vec<Vec<f64>> {
    let flat: Vec<f64> = Vec::try_from(t.flatten(0, -1)).unwrap();
    let width = *t.size().last().unwrap() as usize;
    flat.chunks(width).map(<[f64]>::to_vec).collect()
}

fn vec1(t: &Tensor) -> Vec<f64> {
    Vec::try_from(t.flatten(0, -1)).unwrap()
}

fn close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() < 1e-9, "{what}[{i}]: {x} vs {y}");
    }
}

/// A mask with a different number of sampled tokens per row (row i: the last i+2 tokens).
fn mask() -> Tensor {
    let m: Vec<f64> = (0..B)
        .flat_map(|i| (0..T).map(move |t| if t + i + 2 >= T { 1.0 } else { 0.0 }))
        .collect();
    Tensor::from_slice(&m).view([B as i64, T as i64])
}

fn mean(x: &[f64]) -> f64 {
    x.iter().sum::<f64>() / x.len() as f64
}

fn std(x: &[f64]) -> f64 {
    let m = mean(x);
    (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
}

#[test]
fn grpo_rloo_and_reinforce_pp_match_their_formulas() {
    let r = rand(&[3, 4], 2.0, 1);
    for scale in [true, false] {
        let got = rows(&grpo(&r, scale, 1e-6));
        for (g, row) in rows(&r).iter().enumerate() {
            let want: Vec<f64> = row
                .iter()
                .map(|v| {
                    if scale {
                        (v - mean(row)) / (std(row) + 1e-6)
                    } else {
                        v - mean(row)
                    }
                })
                .collect();
            close(&got[g], &want, "grpo");
        }
    }
    let got = rows(&rloo(&r));
    for (g, row) in rows(&r).iter().enumerate() {
        let want: Vec<f64> = (0..row.len())
            .map(|i| {
                let others: f64 = row
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| *j != i)
                    .map(|(_, v)| v)
                    .sum();
                row[i] - others / (row.len() - 1) as f64
            })
            .collect();
        close(&got[g], &want, "rloo");
    }
    let all = vec1(&r);
    let want: Vec<f64> = all
        .iter()
        .map(|v| (v - mean(&all)) / (std(&all) + 1e-6))
        .collect();
    close(&vec1(&reinforce_pp(&r, 1e-6)), &want, "reinforce++");
    // Identical rewards carry no signal.
    let flat = Tensor::ones([2, 4], (Kind::Double, Device::Cpu));
    assert!(vec1(&grpo(&flat, true, 1e-6))
        .iter()
        .all(|v| v.abs() < 1e-12));
}

#[test]
fn distillation_is_teacher_minus_student_on_sampled_tokens() {
    let (t, s, m) = (
        rand(&[B as i64, T as i64], 1.0, 2),
        rand(&[B as i64, T as i64], 1.0, 3),
        mask(),
    );
    let got = rows(&distillation(&t, &s, &m));
    for i in 0..B {
        for k in 0..T {
            let want = (rows(&t)[i][k] - rows(&s)[i][k]) * rows(&m)[i][k];
            assert!((got[i][k] - want).abs() < 1e-12);
        }
    }
}

fn reference_coef(c: &Correction, log_rho: &[f64], m: &[f64]) -> Vec<f64> {
    let rho: Vec<f64> = log_rho.iter().map(|v| v.exp()).collect();
    let sampled: Vec<f64> = log_rho
        .iter()
        .zip(m)
        .filter(|(_, &mm)| mm == 1.0)
        .map(|(v, _)| *v)
        .collect();
    let u = match c.level {
        Level::Token => None,
        Level::Seq => Some(sampled.iter().sum::<f64>().exp()),
        Level::Geo => Some(if sampled.is_empty() {
            1.0
        } else {
            mean(&sampled).exp()
        }),
    };
    rho.iter()
        .zip(m)
        .map(|(&r, &mm)| {
            let coef = match (c.mode, u) {
                (Mode::Mask, None) => {
                    if c.low <= r && r <= c.high {
                        r
                    } else {
                        0.0
                    }
                }
                (Mode::Clip, None) => r.clamp(c.low, c.high),
                (Mode::Trunc, None) => r.min(c.high),
                (_, Some(u)) => {
                    if c.low <= u && u <= c.high {
                        r
                    } else {
                        0.0
                    }
                }
            };
            coef * mm
        })
        .collect()
}

#[test]
fn is_corrections_match_the_level_mode_table() {
    let log_rho = rand(&[B as i64, T as i64], 0.3, 4);
    let m = mask();
    let cases = [
        Correction {
            level: Level::Token,
            mode: Mode::Mask,
            low: 0.5,
            high: 5.0,
        },
        Correction {
            level: Level::Token,
            mode: Mode::Mask,
            low: 0.9,
            high: 1.1,
        },
        Correction {
            level: Level::Token,
            mode: Mode::Clip,
            low: 0.8,
            high: 1.2,
        },
        Correction {
            level: Level::Token,
            mode: Mode::Trunc,
            low: 0.0,
            high: 1.1,
        },
        Correction {
            level: Level::Seq,
            mode: Mode::Mask,
            low: 0.5,
            high: 2.0,
        },
        Correction {
            level: Level::Geo,
            mode: Mode::Mask,
            low: 0.95,
            high: 1.05,
        },
    ];
    for c in cases {
        let got = rows(&c.coefficients(&log_rho, &m));
        for i in 0..B {
            let want = reference_coef(&c, &rows(&log_rho)[i], &rows(&m)[i]);
            close(&got[i], &want, &format!("{c:?} row {i}"));
        }
    }
}

#[test]
fn is_masks_keep_the_band_edges_and_drop_just_outside() {
    let m = Tensor::ones([1, 4], (Kind::Double, Device::Cpu));
    let rho = Tensor::from_slice(&[0.5, 5.0, 0.4999, 5.0001f64]).view([1, 4]);
    let c = Correction {
        level: Level::Token,
        mode: Mode::Mask,
        low: 0.5,
        high: 5.0,
    };
    close(
        &vec1(&c.coefficients(&rho.log(), &m)),
        &[0.5, 5.0, 0.0, 0.0],
        "token mask edges",
    );
    // A sequence gate: geo mean exactly at the edge passes, just past it zeroes the sequence.
    let c = Correction {
        level: Level::Geo,
        mode: Mode::Mask,
        low: 0.99,
        high: 1.01,
    };
    let inside = Tensor::from_slice(&[1.01f64, 1.01, 1.01, 1.01])
        .view([1, 4])
        .log();
    assert!(vec1(&c.coefficients(&inside, &m)).iter().all(|&v| v > 0.0));
    let outside = Tensor::from_slice(&[1.0102f64, 1.0102, 1.0102, 1.0102])
        .view([1, 4])
        .log();
    assert!(vec1(&c.coefficients(&outside, &m))
        .iter()
        .all(|&v| v == 0.0));
    // Padding never counts: a masked-out token cannot push a sequence out of its band.
    let mut pm = vec![1.0, 1.0, 1.0, 0.0];
    let padded = Tensor::from_slice(&[1.0f64, 1.0, 1.0, 50.0])
        .view([1, 4])
        .log();
    let pmask = Tensor::from_slice(&pm).view([1, 4]);
    assert_eq!(
        vec1(&c.coefficients(&padded, &pmask)),
        vec![1.0, 1.0, 1.0, 0.0]
    );
    pm[3] = 1.0;
    let pmask = Tensor::from_slice(&pm).view([1, 4]);
    assert!(vec1(&c.coefficients(&padded, &pmask))
        .iter()
        .all(|&v| v == 0.0));
}

fn clip(r: f64, lo: f64, hi: f64) -> f64 {
    r.clamp(lo, hi)
}

#[test]
fn ppo_clip_matches_and_clipped_tokens_get_no_gradient() {
    let (el, eh) = (0.2, 0.28);
    let logp_old = rand(&[B as i64, T as i64], 0.5, 5) - 2.0;
    let logp = (&logp_old + rand(&[B as i64, T as i64], 0.3, 6)).set_requires_grad(true);
    let adv = rand(&[B as i64, T as i64], 1.0, 7);
    let coef = rand(&[B as i64, T as i64], 0.1, 8).abs() + 0.9;
    let loss = ppo_clip(&logp, &logp_old, &adv, &coef, el, eh);
    let (lp, lo, a, c) = (
        vec1(&logp.detach()),
        vec1(&logp_old),
        vec1(&adv),
        vec1(&coef),
    );
    let want: Vec<f64> = (0..lp.len())
        .map(|k| {
            let r = (lp[k] - lo[k]).exp();
            -(r * a[k]).min(clip(r, 1.0 - el, 1.0 + eh) * a[k]) * c[k]
        })
        .collect();
    close(&vec1(&loss.detach()), &want, "ppo loss");
    loss.sum(Kind::Double).backward();
    let grad = vec1(&logp.grad());
    for k in 0..lp.len() {
        let r = (lp[k] - lo[k]).exp();
        let clipped = (a[k] > 0.0 && r > 1.0 + eh) || (a[k] < 0.0 && r < 1.0 - el);
        let want = if clipped { 0.0 } else { -r * a[k] * c[k] };
        assert!(
            (grad[k] - want).abs() < 1e-9,
            "token {k}: grad {} want {want} (clipped {clipped})",
            grad[k]
        );
    }
}

#[test]
fn gspo_uses_one_geometric_ratio_per_sequence() {
    let (el, eh) = (3e-4, 4e-4);
    let m = mask();
    let logp_old = rand(&[B as i64, T as i64], 0.5, 9) - 2.0;
    let logp = &logp_old + rand(&[B as i64, T as i64], 0.001, 10);
    let adv = rand(&[B as i64], 1.0, 11);
    let coef = Tensor::ones([B as i64, T as i64], (Kind::Double, Device::Cpu));
    let got = vec1(&gspo(&logp, &logp_old, &adv, &coef, &m, el, eh));
    for i in 0..B {
        let (lp, lo, mm) = (&rows(&logp)[i], &rows(&logp_old)[i], &rows(&m)[i]);
        let d: Vec<f64> = (0..T)
            .filter(|&t| mm[t] == 1.0)
            .map(|t| lp[t] - lo[t])
            .collect();
        let s = mean(&d).exp();
        let a = vec1(&adv)[i];
        let want = -(s * a).min(clip(s, 1.0 - el, 1.0 + eh) * a);
        assert!(
            (got[i] - want).abs() < 1e-9,
            "sequence {i}: {} vs {want}",
            got[i]
        );
    }
}

#[test]
fn cispo_keeps_every_tokens_gradient() {
    let (el, eh) = (0.2, 0.2);
    let logp_old = rand(&[B as i64, T as i64], 0.5, 12) - 2.0;
    let logp = (&logp_old + rand(&[B as i64, T as i64], 0.5, 13)).set_requires_grad(true);
    let adv = rand(&[B as i64, T as i64], 1.0, 14);
    let coef = Tensor::ones([B as i64, T as i64], (Kind::Double, Device::Cpu));
    let loss = cispo(&logp, &logp_old, &adv, &coef, el, eh);
    loss.sum(Kind::Double).backward();
    let (lp, lo, a, g) = (
        vec1(&logp.detach()),
        vec1(&logp_old),
        vec1(&adv),
        vec1(&logp.grad()),
    );
    let mut clipped = 0;
    for k in 0..lp.len() {
        let r = (lp[k] - lo[k]).exp();
        let w = clip(r, 1.0 - el, 1.0 + eh);
        clipped += usize::from(w != r);
        assert!((g[k] - (-w * a[k])).abs() < 1e-9, "token {k}");
        assert!(g[k] != 0.0 || a[k] == 0.0, "token {k}: no gradient dropped");
    }
    assert!(clipped > 0, "the inputs exercise the clip");
}

#[test]
fn aggregations_weigh_tokens_or_sequences() {
    let l = rand(&[B as i64, T as i64], 1.0, 15);
    let m = mask();
    let (lr, mr) = (rows(&l), rows(&m));
    let tok: f64 = (0..B)
        .flat_map(|i| (0..T).map(move |t| (i, t)))
        .map(|(i, t)| lr[i][t] * mr[i][t])
        .sum::<f64>()
        / mr.iter().flatten().sum::<f64>();
    let seq = mean(
        &(0..B)
            .map(|i| (0..T).map(|t| lr[i][t] * mr[i][t]).sum::<f64>() / mr[i].iter().sum::<f64>())
            .collect::<Vec<_>>(),
    );
    close(
        &vec1(&aggregate(&l, &m, Aggregation::TokenMean)),
        &[tok],
        "token-mean",
    );
    close(
        &vec1(&aggregate(&l, &m, Aggregation::SeqMean)),
        &[seq],
        "seq-mean",
    );
    assert!(
        (tok - seq).abs() > 1e-6,
        "different lengths make the two differ"
    );
    // Dr. GRPO: the token sum over B sequences of a constant L tokens each.
    let normalizer = 11;
    let sum: f64 = (0..B)
        .flat_map(|i| (0..T).map(move |t| (i, t)))
        .map(|(i, t)| lr[i][t] * mr[i][t])
        .sum();
    close(
        &vec1(&aggregate(
            &l,
            &m,
            Aggregation::SeqMeanTokenSumNorm { normalizer },
        )),
        &[sum / (B * normalizer) as f64],
        "seq-mean-token-sum-norm",
    );
}

#[test]
fn k3_kl_is_non_negative_and_zero_at_equality() {
    let a = rand(&[B as i64, T as i64], 1.0, 16);
    let b = rand(&[B as i64, T as i64], 1.0, 17);
    let k = vec1(&kl_k3(&a, &b));
    let (av, bv) = (vec1(&a), vec1(&b));
    for i in 0..k.len() {
        let d = bv[i] - av[i];
        assert!((k[i] - (d.exp() - d - 1.0)).abs() < 1e-12);
        assert!(k[i] >= 0.0);
    }
    assert!(vec1(&kl_k3(&a, &a)).iter().all(|&v| v == 0.0));
}
