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

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tch::Tensor;

use super::stream::{bytes_of, Bucket, WeightStream};
use crate::engine::weights::{
    update_info, TcpWeightSender, WeightListener, DEFAULT_PACKED_BUFFER_BYTES,
};

/// Why a weight sync failed: the step and what the engines said.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("weight sync, {step}: {message}")]
    Step { step: &'static str, message: String },
    #[error("weight sync: the data plane is not connected (call connect_tcp first)")]
    NotConnected,
}

pub(crate) fn step(step: &'static str) -> impl Fn(String) -> SyncError {
    move |message| SyncError::Step { step, message }
}

/// What one update cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SyncReport {
    /// From the pause call to the end of the resume call: engines produced nothing meanwhile.
    pub paused: Duration,
    /// The transfer alone (start to finish of the weight update).
    pub transfer: Duration,
    pub bytes: usize,
    pub buckets: usize,
}

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

/// The engine API's control calls (pause, resume, the weight-update routes) to a router, a
/// coordinator (whose router fans them out) or one engine; every transport drives updates with it.
#[derive(Debug, Clone)]
pub struct Control {
    http: reqwest::Client,
    target: String,
}

impl Control {
    pub fn new(target: &str) -> Self {
        Self {
            http: crate::auth::client(),
            target: target.trim_end_matches('/').to_string(),
        }
    }

    pub fn target(&self) -> &str {
        &self.target
    }

    /// `method path` with an optional JSON body; the answer's JSON (`null` when it has none), or
    /// the URL, status and body of a refusal.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, String> {
        let url = format!("{}{}", self.target, path);
        let mut req = self.http.request(method, &url);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let r = req.send().await.map_err(|e| format!("{url}: {e}"))?;
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(format!("{url}: {status} {text}"));
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::Null))
    }

    pub async fn post(&self, path: &str, body: Value) -> Result<Value, String> {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    /// Pauses every engine: `keep` freezes requests in flight (partial rollout), `wait` lets
    /// them finish under the old weights first.
    pub async fn pause(&self, partial_rollout: bool) -> Result<(), SyncError> {
        let mode = if partial_rollout { "keep" } else { "wait" };
        self.call(reqwest::Method::POST, &format!("/pause?mode={mode}"), None)
            .await
            .map(drop)
            .map_err(step("pause"))
    }

    pub async fn resume(&self) -> Result<(), SyncError> {
        self.call(reqwest::Method::POST, "/resume", None)
            .await
            .map(drop)
            .map_err(step("resume"))
    }

    /// Tells every engine, and the router in front of them (which then routes only to engines
    /// that have it), the version they now serve.
    pub async fn set_version(&self, version: u64) -> Result<(), SyncError> {
        self.post(
            "/update_weight_version",
            json!({"new_version": version.to_string()}),
        )
        .await
        .map(drop)
        .map_err(step("update_weight_version"))
    }
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

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, String> {
        self.control.call(method, path, body).await
    }

    async fn world_size(&self) -> Result<usize, SyncError> {
        let world = self
            .call(reqwest::Method::GET, "/get_world_size", None)
            .await
            .map_err(step("get_world_size"))?;
        Ok(world["world_size"].as_u64().unwrap_or(1) as usize)
    }

    /// Opens the TCP data plane: listens on `bind` (`127.0.0.1:0`, `0.0.0.0:29500`), tells every
    /// engine to connect to `advertise:port`, and waits for all of them. [`update`](Self::update)
    /// connects again by itself when engines joined or left since.
    pub async fn connect_tcp(&mut self, bind: &str, advertise: &str) -> Result<(), SyncError> {
        self.sender = None;
        let engines = self.world_size().await?;
        let listener =
            WeightListener::bind(bind).map_err(|e| step("listen")(format!("{bind}: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| step("listen")(e.to_string()))?
            .port();
        let accept = tokio::task::spawn_blocking(move || listener.accept(engines));
        let init = json!({"init_info": {"master_address": advertise, "master_port": port,
            "rank_offset": 1, "world_size": engines + 1,
            "packed_buffer_size_bytes": self.packed_buffer_bytes}});
        let told = self
            .call(
                reqwest::Method::POST,
                "/init_weight_transfer_engine",
                Some(init),
            )
            .await;
        if let Err(message) = told {
            // Nobody will connect: end the accept by connecting to ourselves is not possible in
            // general, so report; the listener thread ends when its socket times out.
            return Err(step("init_weight_transfer_engine")(message));
        }
        let sender = accept
            .await
            .map_err(|e| step("accept")(e.to_string()))?
            .map_err(|e| step("accept")(e.to_string()))?;
        self.sender = Some(sender);
        self.plane = Some((bind.to_string(), advertise.to_string(), engines));
        Ok(())
    }

    /// Pushes `tensors` as `version`: pause (`keep` with partial rollout, else `wait`), transfer in
    /// buckets, finish, resume. The engines are resumed even when the transfer fails.
    pub async fn update(
        &mut self,
        tensors: &[(String, Tensor)],
        version: u64,
        partial_rollout: bool,
    ) -> Result<SyncReport, SyncError> {
        self.update_stream(WeightStream::whole(tensors), version, partial_rollout)
            .await
    }

    /// [`update`](Self::update) from buckets as they come: each is sent as soon as it arrives.
    pub async fn update_stream(
        &mut self,
        weights: WeightStream,
        version: u64,
        partial_rollout: bool,
    ) -> Result<SyncReport, SyncError> {
        let Some((bind, advertise, ranks)) = self.plane.clone() else {
            return Err(SyncError::NotConnected);
        };
        // Engines joined or left (or a failed transfer dropped the stream): connect again.
        if self.sender.is_none() || self.world_size().await? != ranks {
            self.connect_tcp(&bind, &advertise).await?;
        }
        let paused_at = Instant::now();
        self.control.pause(partial_rollout).await?;
        let transferred = self.transfer(weights, version).await;
        if transferred.is_err() {
            // An engine may have been replaced (same address and count, but a fresh process
            // without the weight stream): the next update connects every engine again.
            self.sender = None;
        }
        // The built-in engine stages a transfer and swaps only at its finish: after a failed
        // one it still holds the previous weights whole, so resuming is safe.
        let resumed = self.control.resume().await;
        let paused = paused_at.elapsed();
        let (transfer, bytes, buckets) = transferred?;
        resumed?;
        Ok(SyncReport {
            paused,
            transfer,
            bytes,
            buckets,
        })
    }

    async fn transfer(
        &mut self,
        mut weights: WeightStream,
        version: u64,
    ) -> Result<(Duration, usize, usize), SyncError> {
        let started = Instant::now();
        self.call(
            reqwest::Method::POST,
            "/start_weight_update",
            Some(json!({})),
        )
        .await
        .map_err(step("start_weight_update"))?;
        let (mut count, mut bytes) = (0, 0);
        while let Some(pieces) = weights.next_split(self.bucket_bytes).await? {
            for bucket in pieces {
                count += 1;
                bytes += bucket.iter().map(|(_, t)| bytes_of(t)).sum::<usize>();
                self.send_bucket(bucket).await?;
            }
        }
        // Only a whole stream finishes: the engines swap to the new weights at this call.
        self.call(
            reqwest::Method::POST,
            "/finish_weight_update",
            Some(json!({"weight_version": version})),
        )
        .await
        .map_err(step("finish_weight_update"))?;
        Ok((started.elapsed(), bytes, count))
    }

    async fn send_bucket(&mut self, bucket: Bucket) -> Result<(), SyncError> {
        let info = update_info(&bucket);
        let mut sender = self.sender.take().ok_or(SyncError::NotConnected)?;
        let flush = self.packed_buffer_bytes;
        let send = tokio::task::spawn_blocking(move || {
            let result = sender.send_bucket(&bucket, flush);
            (sender, result)
        });
        let told = self
            .call(
                reqwest::Method::POST,
                "/update_weights",
                Some(json!({"update_info": info})),
            )
            .await;
        let (sender, sent) = send.await.map_err(|e| step("send")(e.to_string()))?;
        // A stream that failed mid-bucket is desynchronised: reconnect before the next update.
        if sent.is_ok() && told.is_ok() {
            self.sender = Some(sender);
        }
        sent.map_err(|e| step("send")(e.to_string()))?;
        told.map_err(step("update_weights"))?;
        Ok(())
    }
}
