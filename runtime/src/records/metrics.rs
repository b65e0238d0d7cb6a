//! What a run reports: one JSON object per training step in `<out>/metrics.jsonl`, a progress
//! line per step on stderr, and at the end the reward curve (`reward.svg`) and a summary.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Result, RunError};
use crate::rollout::eval::EvalResult;

/// Records written before `trainer_world_size` existed were of one rank.
fn one() -> usize {
    1
}

/// One training step, as a line of `metrics.jsonl`.
/// A field missing from a line (one an earlier version wrote) reads as its default.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct StepRecord {
    pub step: u64,
    /// The version the step produced (what engines serve after its weight sync).
    pub policy_version: u64,
    pub reward_mean: f64,
    pub reward_std: f64,
    pub episodes: usize,
    pub advantage_mean: f64,
    pub advantage_std: f64,
    pub loss: f64,
    /// Mean |log ρ| = |log π_old − log μ| over sampled tokens (engine/trainer mismatch and
    /// staleness together).
    pub mean_abs_log_rho: f64,
    /// Sampled tokens the IS correction gave weight 0.
    pub masked_fraction: f64,
    pub entropy: f64,
    pub kl: f64,
    /// On-policy distillation: mean per-token reverse KL to the teacher, log μ − log π_teacher.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_kl: Option<f64>,
    /// Overlong reward shaping (`algorithm.overlong`): the mean penalty added to the batch's
    /// rewards (≤ 0; `reward_mean` is the rewards before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlong_penalty_mean: Option<f64>,
    /// LLM-as-judge rewards: mean of the agents' own rewards (the environment's or the agent
    /// program's, before the judge's score was mixed in; `reward_mean` is the mixed reward).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_reward_mean: Option<f64>,
    /// LLM-as-judge rewards: mean judge score in [0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judge_score_mean: Option<f64>,
    /// LLM-as-judge rewards: judge answers with no number and no yes/no (scored 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judge_unparsed: Option<usize>,
    /// LLM-as-judge rewards: judge requests that failed (scored 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judge_failed: Option<usize>,
    /// LLM-as-judge rewards: seconds the step waited for the judge's verdicts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judge_seconds: Option<f64>,
    /// Distillation with a served teacher: seconds its engines took to score the batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher_seconds: Option<f64>,
    /// Trainer ranks that computed the step (`trainer.nodes`; docs/distributed.md).
    #[serde(default = "one")]
    pub trainer_world_size: usize,
    pub grad_norm: f64,
    /// The loss or gradient norm was not finite, so the step did not change the weights (`loss`
    /// and `grad_norm` are then recorded as 0: JSON has no NaN).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub update_skipped: bool,
    pub learning_rate: f64,
    /// Sampled tokens by how many versions behind the policy that trained on them they were.
    pub staleness: BTreeMap<u64, usize>,
    pub staleness_mean: f64,
    pub sequences: usize,
    pub sampled_tokens: usize,
    pub response_tokens_mean: f64,
    /// Sampled tokens of the batch per second of this step's wall time.
    pub tokens_per_second: f64,
    pub step_seconds: f64,
    pub train_seconds: f64,
    pub sync_seconds: f64,
    pub dropped_stale: u64,
    pub dropped_failed: u64,
    /// Groups dropped because an episode was malformed (docs/security.md, "Bad data").
    pub dropped_invalid: u64,
    /// Groups dynamic sampling dropped because every reward was equal (so far in the run).
    pub groups_filtered: u64,
    /// Batches the trainer could not learn from, set aside in `<out>/quarantine/` (so far in the
    /// run; docs/security.md, "Bad data").
    pub batches_quarantined: u64,
    /// Seconds since the run (this process) started.
    pub elapsed_seconds: f64,
    /// Fraction of the step's wall-clock in which the engines had work (requests in flight,
    /// not paused), over all engines (docs/run.md, "How busy engines and trainer were").
    pub engine_busy_fraction: f64,
    /// Fraction of the step's wall-clock in which the trainer computed (advantages, the
    /// teacher's scores, the optimizer step).
    pub trainer_busy_fraction: f64,
    /// Seconds of the step the engines sat paused for weight sync.
    pub engine_paused_seconds: f64,
    /// The newest evaluation since the previous record (`spec.eval`; every evaluation is in
    /// `eval.jsonl`): the step whose policy it measured (the one before this step trained),
    /// its mean reward and pass@k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_reward_mean: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_pass_at_k: Option<f64>,
}

/// `metrics.jsonl`, appended one line per step, and the same numbers as TensorBoard events under
/// `<out>/tensorboard/`.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    records: Vec<StepRecord>,
    /// `eval.jsonl` and the evaluations in it.
    eval_path: PathBuf,
    evals: Vec<EvalResult>,
    /// `None` when the event file could not be made (said once; `metrics.jsonl` goes on).
    tensorboard: Option<super::tensorboard::EventWriter>,
}

impl MetricsLog {
    /// Opens `<out>/metrics.jsonl`, keeping only steps up to `resume_step` (a resumed run trains
    /// the later ones again, so each step appears once).
    pub fn open(out: &Path, resume_step: u64) -> Result<Self> {
        let path = out.join("metrics.jsonl");
        let records = keep_lines(&path, |r: &StepRecord| r.step <= resume_step)?;
        // The evaluation at `resume_step` is run again after the resume.
        let eval_path = out.join("eval.jsonl");
        let evals = keep_lines(&eval_path, |e: &EvalResult| e.step < resume_step)?;
        let tensorboard = super::tensorboard::EventWriter::create(&out.join("tensorboard"))
            .inspect_err(|e| tracing::warn!("no TensorBoard events for this run: {e}"))
            .ok();
        Ok(Self {
            path,
            records,
            eval_path,
            evals,
            tensorboard,
        })
    }

    pub fn push(&mut self, record: StepRecord) -> Result<()> {
        self.append(false, record.step, &record)?;
        self.records.push(record);
        Ok(())
    }

    /// Appends an evaluation to `eval.jsonl`, and its numbers to TensorBoard at the step it
    /// measured.
    pub fn push_eval(&mut self, eval: EvalResult) -> Result<()> {
        self.append(true, eval.step, &eval)?;
        self.evals.push(eval);
        Ok(())
    }

    /// Appends `item` to `eval.jsonl` (an evaluation) or `metrics.jsonl`, and its numbers to
    /// TensorBoard at `step`. A step record's `eval_` fields are left out there: TensorBoard has
    /// them at the step the evaluation measured, from `eval.jsonl`.
    fn append(&mut self, eval: bool, step: u64, item: &impl Serialize) -> Result<()> {
        let path = if eval { &self.eval_path } else { &self.path };
        std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .and_then(|mut f| f.write_all(&lines(std::slice::from_ref(item))))
            .map_err(|e| RunError::file("writing", path, e))?;
        let value = serde_json::to_value(item).expect("records serialize");
        let mut scalars = super::tensorboard::scalars_of(&value);
        scalars.retain(|(tag, _)| tag.starts_with("eval_") == eval);
        if let Some(tb) = &mut self.tensorboard {
            if let Err(e) = tb.scalars(step, &scalars) {
                let path = tb.path().display();
                tracing::warn!("writing {path}: {e}; no more TensorBoard events");
                self.tensorboard = None;
            }
        }
        Ok(())
    }

    pub fn records(&self) -> &[StepRecord] {
        &self.records
    }

    pub fn evals(&self) -> &[EvalResult] {
        &self.evals
    }
}

/// The JSON lines of `path` that parse as `T` and pass `keep` (none when there is no file),
/// written back as the whole file.
fn keep_lines<T: Serialize + DeserializeOwned>(
    path: &Path,
    keep: impl Fn(&T) -> bool,
) -> Result<Vec<T>> {
    let items: Vec<T> = match std::fs::read_to_string(path) {
        Ok(text) => text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(keep)
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        // Anything else (permissions, I/O): stop rather than write the log anew, empty.
        Err(e) => return Err(super::files::io("reading", path, e)),
    };
    super::files::write_atomic(path, &lines(&items))?;
    Ok(items)
}

fn lines<T: Serialize>(items: &[T]) -> Vec<u8> {
    let mut text = Vec::new();
    for item in items {
        serde_json::to_writer(&mut text, item).expect("records serialize");
        text.push(b'\n');
    }
    text
}

fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}h{:02}m", s / 3600, (s % 3600) / 60)
    } else {
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

/// The progress line of a step: step, reward (with a judge: the agent's own reward and the
/// judge's score too), version, staleness, tokens/s, ETA.
pub fn progress_line(r: &StepRecord, total: u64, eta: Option<Duration>) -> String {
    let judged = match (r.agent_reward_mean, r.judge_score_mean) {
        (Some(agent), Some(judge)) => format!(" (agent {agent:.3}, judge {judge:.3})"),
        _ => String::new(),
    };
    format!(
        "step {:>4}/{total} | reward {:.3}{judged} | version {} | staleness {:.2} | {:.0} tok/s | |log ρ| {:.4} | grad {:.3} | {:.1}s/step | ETA {}",
        r.step,
        r.reward_mean,
        r.policy_version,
        r.staleness_mean,
        r.tokens_per_second,
        r.mean_abs_log_rho,
        r.grad_norm,
        r.step_seconds,
        eta.map_or_else(|| "-".into(), clock),
    ) + if r.update_skipped {
        " | update skipped: non-finite loss or gradient"
    } else {
        ""
    }
}

/// The reward curve as an SVG image: mean reward per step, with its ±std band.
pub fn reward_svg(records: &[StepRecord], title: &str) -> String {
    let (w, h, left, right, top, bottom) = (720.0, 400.0, 60.0, 20.0, 40.0, 50.0);
    let x0 = records.first().map_or(0.0, |r| r.step as f64);
    let x1 = records.last().map_or(1.0, |r| r.step as f64).max(1.0);
    let (lo, hi) = records.iter().fold((0.0f64, 1.0f64), |(lo, hi), r| {
        let (mean, std) = (r.reward_mean, r.reward_std);
        (lo.min(mean - std), hi.max(mean + std))
    });
    let x = |s: f64| left + (s - x0) / (x1 - x0).max(1.0) * (w - left - right);
    let y = |v: f64| top + (hi - v) / (hi - lo).max(1e-9) * (h - top - bottom);
    // A record's point `k` standard deviations from its mean.
    let point = |r: &StepRecord, k: f64| {
        let v = r.reward_mean + k * r.reward_std;
        format!("{:.1},{:.1}", x(r.step as f64), y(v))
    };
    let edge = |k: f64| records.iter().map(move |r| point(r, k));
    // The band: its upper edge forward, its lower edge back.
    let band: Vec<String> = edge(1.0).chain(edge(-1.0).rev()).collect();
    let mean: Vec<String> = edge(0.0).collect();
    let mut svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{tx}" y="24" text-anchor="middle" font-size="15">{title}</text>
<polygon points="{band}" fill="#4c78a8" fill-opacity="0.15"/>
<polyline points="{mean}" fill="none" stroke="#4c78a8" stroke-width="2"/>
"##,
        tx = w / 2.0,
        title = title.replace('&', "&amp;").replace('<', "&lt;"),
        band = band.join(" "),
        mean = mean.join(" "),
    );
    // Five ticks on each axis: a grid line and label per reward, a label per step.
    for k in 0..=4 {
        let v = lo + (hi - lo) * k as f64 / 4.0;
        let s = x0 + (x1 - x0) * k as f64 / 4.0;
        svg += &format!(
            "<line x1=\"{left}\" x2=\"{:.1}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#ddd\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{v:.2}</text>\n<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{s:.0}</text>\n",
            w - right,
            left - 6.0,
            y(v) + 4.0,
            x(s),
            h - bottom + 18.0,
            yy = y(v),
        );
    }
    svg += &format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">step</text>\n<text x=\"16\" y=\"{:.1}\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">reward (mean ± std)</text>\n</svg>\n",
        (left + w - right) / 2.0,
        h - 12.0,
        h / 2.0,
        h / 2.0
    );
    svg
}

/// The mean of `f` over the last `n` records that have it (`None` when none has).
pub fn recent_mean(
    records: &[StepRecord],
    n: usize,
    f: impl Fn(&StepRecord) -> Option<f64>,
) -> Option<f64> {
    let recent: Vec<f64> = records.iter().rev().filter_map(f).take(n).collect();
    (!recent.is_empty()).then(|| recent.iter().sum::<f64>() / recent.len() as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(step: u64, reward: f64) -> StepRecord {
        StepRecord {
            step,
            policy_version: step,
            reward_mean: reward,
            ..StepRecord::default()
        }
    }

    #[test]
    fn a_resumed_log_keeps_only_checkpointed_steps() {
        let out = std::env::temp_dir().join(format!("moult-metrics-test-{}", std::process::id()));
        std::fs::create_dir_all(&out).unwrap();
        let mut log = MetricsLog::open(&out, 0).unwrap();
        for s in 1..=5 {
            log.push(record(s, s as f64 / 10.0)).unwrap();
        }
        let log = MetricsLog::open(&out, 3).unwrap();
        let steps: Vec<u64> = log.records().iter().map(|r| r.step).collect();
        assert_eq!(steps, vec![1, 2, 3]);
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        assert_eq!(text.lines().count(), 3);
        assert!(
            (recent_mean(log.records(), 2, |r| Some(r.reward_mean)).unwrap() - 0.25).abs() < 1e-12
        );
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn the_reward_plot_is_an_svg_with_one_point_per_step() {
        let records: Vec<StepRecord> = (1..=10).map(|s| record(s, s as f64 / 10.0)).collect();
        let svg = reward_svg(&records, "demo <run>");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("demo &lt;run>"));
        let points = svg
            .lines()
            .find(|l| l.starts_with("<polyline"))
            .unwrap()
            .matches(',')
            .count();
        assert_eq!(points, 10);
    }
}
