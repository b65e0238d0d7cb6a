//! One weight update as the trainer side runs it (docs/engine.md): pause every engine, transfer
//! the new weights, finish with the new version, resume.
//!
//! With partial rollout the pause is `keep`: requests in flight are frozen, not dropped, and after
//! the resume they continue under the new weights; the engines' `weight_versions` spans say which
//! tokens came from which version. Without it the pause is `wait`: in-flight requests finish under
//! the old weights first. The target is the router (which fans every call out to its engines, with
//! rank offsets) or a single engine: the same engine API either way.
//!
//! The data plane here is TCP (built-in engines): the trainer listens, each engine connects and
//! announces its rank, and every bucket's tensors travel as one packed byte stream
//! ([`crate::engine::weights`]). A failed update still resumes the engines, so a broken transfer
//! never leaves a run paused.

use std::time::Instant;

use serde_json::json;

use super::stream::{Bucket, WeightStream};
use super::{Control, Result, SyncError, SyncReport};
use crate::engine::weights::{
    update_info, TcpWeightSender, WeightListener, DEFAULT_PACKED_BUFFER_BYTES,
};

/// Drives weight updates of the engines behind `target`.
#[derive(Debug)]
pub struct WeightSync {
    control: Control,
    sender: Option<TcpWeightSender>,
    /// Where the data plane listens and what engines are told, and how many ranks connected.
    plane: Option<(String, String, usize)>,
    /// Tensors are grouped into buckets of about this many bytes (one `update_weights` each).
    pub bucket_bytes: usize,
    /// Flush size of the packed stream.
    pub packed_buffer_bytes: usize,
}

impl WeightSync {
    /// Updates for the engines behind `target` (a router or an engine base URL).
    pub fn new(target: &str) -> Self {
        Self {
            control: Control::new(target),
            sender: None,
            plane: None,
            bucket_bytes: 256 << 20,
            packed_buffer_bytes: DEFAULT_PACKED_BUFFER_BYTES,
        }
    }

    async fn world_size(&self) -> Result<usize> {
        let world = self.control.get("get_world_size").await?;
        Ok(world["world_size"].as_u64().unwrap_or(1) as usize)
    }

    /// Opens the TCP data plane: listens on `bind` (`127.0.0.1:0`, `0.0.0.0:29500`), tells every
    /// engine to connect to `advertise:port`, and waits for all of them. [`update_stream`](Self::update_stream)
    /// connects again by itself when engines joined or left since.
    pub async fn connect_tcp(&mut self, bind: &str, advertise: &str) -> Result<()> {
        self.sender = None;
        let engines = self.world_size().await?;
        let listen = |e| SyncError::Listen(bind.to_string(), e);
        let listener = WeightListener::bind(bind).map_err(listen)?;
        let port = listener.local_addr().map_err(listen)?.port();
        let accept = tokio::task::spawn_blocking(move || listener.accept(engines));
        let init = json!({"init_info": {"master_address": advertise, "master_port": port,
            "rank_offset": 1, "world_size": engines + 1,
            "packed_buffer_size_bytes": self.packed_buffer_bytes}});
        // Refused, nobody will connect: the listener thread ends when its socket times out.
        self.control
            .post("init_weight_transfer_engine", init)
            .await?;
        let accepted = accept.await.map_err(SyncError::at("accept"))?;
        self.sender = Some(accepted.map_err(SyncError::at("accept"))?);
        self.plane = Some((bind.to_string(), advertise.to_string(), engines));
        Ok(())
    }

    /// Pushes the buckets of `weights` as `version`, each sent as soon as it arrives: pause
    /// (`keep` with partial rollout, else `wait`), transfer in buckets, finish, resume. The
    /// engines are resumed even when the transfer fails.
    pub async fn update_stream(
        &mut self,
        weights: WeightStream,
        version: u64,
        partial_rollout: bool,
    ) -> Result<SyncReport> {
        let (bind, advertise, ranks) = self.plane.clone().ok_or(SyncError::NotConnected)?;
        // Engines joined or left (or a failed transfer dropped the stream): connect again.
        if self.sender.is_none() || self.world_size().await? != ranks {
            self.connect_tcp(&bind, &advertise).await?;
        }
        let paused_at = Instant::now();
        self.control.pause(partial_rollout).await?;
        let started = Instant::now();
        let transferred = self.transfer(weights, version).await;
        let transfer = started.elapsed();
        if transferred.is_err() {
            // An engine may have been replaced (same address and count, but a fresh process
            // without the weight stream): the next update connects every engine again.
            self.sender = None;
        }
        // The built-in engine stages a transfer and swaps only at its finish: after a failed
        // one it still holds the previous weights whole, so resuming is safe.
        let resumed = self.control.resume().await;
        let mut report = transferred?;
        report.paused = paused_at.elapsed();
        report.transfer = transfer;
        resumed?;
        Ok(report)
    }

    /// Start, each bucket as it comes, finish (only once the stream ended whole); what was sent.
    async fn transfer(&mut self, mut weights: WeightStream, version: u64) -> Result<SyncReport> {
        self.control.post("start_weight_update", json!({})).await?;
        let mut sent = SyncReport::default();
        while let Some(pieces) = weights.next_split(self.bucket_bytes).await? {
            for bucket in pieces {
                sent.count(&bucket);
                self.send_bucket(bucket).await?;
            }
        }
        // Only a whole stream finishes: the engines swap to the new weights at this call.
        let finish = json!({"weight_version": version});
        self.control.post("finish_weight_update", finish).await?;
        Ok(sent)
    }

    async fn send_bucket(&mut self, bucket: Bucket) -> Result<()> {
        let body = json!({"update_info": update_info(&bucket)});
        let mut sender = self.sender.take().ok_or(SyncError::NotConnected)?;
        let flush = self.packed_buffer_bytes;
        let send = tokio::task::spawn_blocking(move || {
            let result = sender.send_bucket(&bucket, flush);
            (sender, result)
        });
        let told = self.control.post("update_weights", body).await;
        let (sender, sent) = send.await.map_err(SyncError::at("send"))?;
        // A stream that failed mid-bucket is desynchronised: reconnect before the next update.
        if sent.is_ok() && told.is_ok() {
            self.sender = Some(sender);
        }
        sent.map_err(SyncError::at("send"))?;
        told.map(drop)
    }
}
