//! New weights as they come (docs/weight-sync.md, "From a sharded trainer"): buckets of named
//! tensors, produced by a trainer that gathers them one unit at a time on its compute thread and
//! consumed by a transport as they arrive. The channel holds one bucket ahead of the consumer, so
//! the next gather runs while the current bucket is sent, and no more than two buckets are whole
//! at once on the sending rank.

use tch::Tensor;
use tokio::sync::mpsc;

use super::{Result, SyncError};
use crate::trainer::bytes_of;

/// A bucket of tensors: shallow copies, so they can move to the sending thread.
pub type Bucket = Vec<(String, Tensor)>;

/// Groups `tensors` into buckets of about `bucket_bytes` (a tensor larger than that gets a bucket
/// of its own).
pub fn buckets(tensors: &[(String, Tensor)], bucket_bytes: usize) -> Vec<Bucket> {
    let mut out: Vec<Bucket> = Vec::new();
    let mut size = 0;
    for (name, t) in tensors {
        let bytes = bytes_of(t);
        if out.is_empty() || (size + bytes > bucket_bytes && size > 0) {
            out.push(Vec::new());
            size = 0;
        }
        size += bytes;
        out.last_mut()
            .expect("a bucket was pushed")
            .push((name.clone(), t.shallow_clone()));
    }
    out
}

/// The receiving end: what a transport reads one update's buckets from. Each message is a
/// bucket, or `None`: every bucket was sent.
#[derive(Debug)]
pub struct WeightStream {
    rx: mpsc::Receiver<Option<Bucket>>,
}

/// The producing end. A stream ends whole only with [`BucketSender::done`]; a producer dropped
/// before that (its gather failed) ends it with an error, so no transport finishes an update
/// with part of the weights.
#[derive(Debug)]
pub struct BucketSender {
    tx: mpsc::Sender<Option<Bucket>>,
}

impl BucketSender {
    /// Hands a bucket over, waiting while the consumer still holds the previous one (call from a
    /// blocking thread). `false` once the consumer is gone (its update failed or ended early).
    pub fn send(&self, bucket: Bucket) -> bool {
        self.tx.blocking_send(Some(bucket)).is_ok()
    }

    /// Every bucket was sent (call from a blocking thread).
    pub fn done(self) {
        let _ = self.tx.blocking_send(None);
    }
}

impl WeightStream {
    /// A stream and its producer, one bucket of slack between them.
    pub fn channel() -> (BucketSender, WeightStream) {
        let (tx, rx) = mpsc::channel(1);
        (BucketSender { tx }, WeightStream { rx })
    }

    /// Weights already whole, as one bucket (each transport splits it to its own bucket size).
    pub fn whole(tensors: &[(String, Tensor)]) -> Self {
        let (tx, rx) = mpsc::channel(2);
        let bucket = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        tx.try_send(Some(bucket))
            .expect("an empty channel has room");
        tx.try_send(None).expect("room for two");
        WeightStream { rx }
    }

    /// The next bucket; `None` once every bucket came, an error if the producer stopped short.
    pub async fn next(&mut self) -> Result<Option<Bucket>> {
        self.rx.recv().await.ok_or(SyncError::Gather)
    }

    /// [`WeightStream::next`] from a blocking thread.
    pub fn blocking_next(&mut self) -> Result<Option<Bucket>> {
        self.rx.blocking_recv().ok_or(SyncError::Gather)
    }

    /// The next bucket split into pieces of about `bucket_bytes`.
    pub async fn next_split(&mut self, bucket_bytes: usize) -> Result<Option<Vec<Bucket>>> {
        Ok(self.next().await?.map(|b| buckets(&b, bucket_bytes)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(n: i64) -> Tensor {
        Tensor::zeros([n], (tch::Kind::Float, tch::Device::Cpu))
    }

    #[test]
    fn buckets_group_tensors_up_to_the_size() {
        let tensors: Vec<(String, Tensor)> = [10, 10, 30, 5, 100]
            .iter()
            .enumerate()
            .map(|(i, &n)| (format!("w{i}"), t(n)))
            .collect();
        let b = buckets(&tensors, 80);
        let names: Vec<Vec<&str>> = b
            .iter()
            .map(|b| b.iter().map(|(n, _)| n.as_str()).collect())
            .collect();
        // 40 + 40 bytes fill the first; a tensor larger than a bucket (w2: 120 bytes, w4) gets
        // one of its own, and nothing joins a full one.
        assert_eq!(
            names,
            vec![vec!["w0", "w1"], vec!["w2"], vec!["w3"], vec!["w4"]]
        );
    }

    #[tokio::test]
    async fn a_stream_carries_buckets_in_order_and_ends_whole_only_when_told() {
        let (tx, mut stream) = WeightStream::channel();
        let producer = tokio::task::spawn_blocking(move || {
            let sent: Vec<bool> = (0..3)
                .map(|i| tx.send(vec![(format!("w{i}"), t(i + 1))]))
                .collect();
            tx.done();
            sent
        });
        let mut names = Vec::new();
        while let Some(bucket) = stream.next().await.unwrap() {
            names.push(bucket[0].0.clone());
        }
        assert_eq!(names, ["w0", "w1", "w2"]);
        assert_eq!(producer.await.unwrap(), [true; 3]);

        // A producer that stops short (its gather failed) is an error, not an end.
        let (tx, mut stream) = WeightStream::channel();
        let producer = tokio::task::spawn_blocking(move || tx.send(vec![("w0".into(), t(1))]));
        assert!(stream.next().await.unwrap().is_some());
        assert!(producer.await.unwrap());
        let err = stream.next().await.unwrap_err().to_string();
        assert!(err.contains("stopped before"), "{err}");

        // A consumer that leaves does not block its producer.
        let (tx, stream) = WeightStream::channel();
        drop(stream);
        let sent = tokio::task::spawn_blocking(move || tx.send(Vec::new()));
        assert!(!sent.await.unwrap(), "nobody reads any more");

        let mut whole = WeightStream::whole(&[("a".into(), t(3)), ("b".into(), t(3))]);
        let pieces = whole.next_split(12).await.unwrap().unwrap();
        assert_eq!(pieces.len(), 2, "split to the transport's bucket size");
        assert!(
            whole.next().await.unwrap().is_none(),
            "one bucket, then the end"
        );
    }
}
