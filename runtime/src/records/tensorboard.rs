//! TensorBoard event files: every number of `metrics.jsonl`, under the same names, in
//! `<out>/tensorboard/` (docs/run.md), so that TensorBoard shows a run and W&B
//! (`wandb sync --sync-tensorboard`) or MLflow import it.
//!
//! An event file is a sequence of TFRecords (the length as u64 LE, the masked CRC-32C of those 8
//! bytes, the data, the masked CRC-32C of the data), each holding one `tensorflow.Event`
//! message: first one with `file_version` `brain.Event:2`, then one per step with a `Summary` of
//! scalar values. The two messages are declared here with prost's derive, by their field
//! numbers in TensorFlow's `event.proto` and `summary.proto`.

use std::io::Write;
use std::path::{Path, PathBuf};

use prost::Message;

#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    /// One of the `what` oneof: set on the file's first event only.
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    /// One of the `what` oneof: a step's values.
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    /// One of the `value` oneof: a scalar.
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// TFRecord's checksum: CRC-32C, rotated and offset.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

fn now() -> f64 {
    chrono::Utc::now().timestamp_micros() as f64 / 1e6
}

/// One event file of a run (a process writes a file of its own; TensorBoard reads them all).
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: std::fs::File,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<seconds>.<host>.<pid>` with its version event.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let (secs, pid) = (now() as u64, std::process::id());
        let path = dir.join(format!("events.out.tfevents.{secs}.{host}.{pid}"));
        let file = std::fs::File::create(&path)?;
        let mut writer = Self { path, file };
        writer.write(Event {
            file_version: Some("brain.Event:2".into()),
            ..Event::default()
        })?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `event`, stamped with the time now.
    fn write(&mut self, mut event: Event) -> std::io::Result<()> {
        event.wall_time = now();
        self.file.write_all(&record(&event.encode_to_vec()))?;
        self.file.flush()
    }

    /// Writes `scalars` (tag, value) as one event of `step`.
    pub fn scalars(&mut self, step: u64, scalars: &[(String, f64)]) -> std::io::Result<()> {
        let value = scalars.iter().map(|(tag, v)| SummaryValue {
            tag: tag.clone(),
            simple_value: Some(*v as f32),
        });
        self.write(Event {
            step: i64::try_from(step).unwrap_or(i64::MAX),
            summary: Some(Summary {
                value: value.collect(),
            }),
            ..Event::default()
        })
    }
}

/// The scalars of a `metrics.jsonl` record: every number under its field name, every number of
/// a nested object under `field/key` (the staleness histogram: `staleness/1`), booleans as 0/1.
pub fn scalars_of(record: &serde_json::Value) -> Vec<(String, f64)> {
    fn walk(tag: String, v: &serde_json::Value, out: &mut Vec<(String, f64)>) {
        match v {
            serde_json::Value::Number(n) => out.extend(n.as_f64().map(|x| (tag, x))),
            serde_json::Value::Bool(b) => out.push((tag, f64::from(u8::from(*b)))),
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    walk(format!("{tag}/{k}"), v, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for (k, v) in record.as_object().into_iter().flatten() {
        walk(k.clone(), v, &mut out);
    }
    out.retain(|(tag, _)| tag != "step");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TFRecord's masked CRC-32C, as TensorFlow's own writer computes it: the CRC-32C check
    /// value of "123456789" is 0xe3069283 (RFC 3720), masked.
    #[test]
    fn records_are_framed_with_masked_crc32c() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(
            masked_crc(b"123456789"),
            0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
        let r = record(b"abc");
        assert_eq!(&r[..8], &3u64.to_le_bytes());
        assert_eq!(&r[12..15], b"abc");
        assert_eq!(r.len(), 8 + 4 + 3 + 4);
    }

    #[test]
    fn every_number_of_a_record_is_a_scalar() {
        let record = serde_json::json!({"step": 3, "reward_mean": 0.5, "staleness": {"0": 10, "1": 2}, "update_skipped": true, "note": "x"});
        let scalars = scalars_of(&record);
        assert_eq!(
            scalars,
            vec![
                ("reward_mean".to_string(), 0.5),
                ("staleness/0".to_string(), 10.0),
                ("staleness/1".to_string(), 2.0),
                ("update_skipped".to_string(), 1.0),
            ]
        );
    }
}
