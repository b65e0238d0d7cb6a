//! The agent pod's side (docs/security.md, "Sandbox pods"): a server on the pod's 127.0.0.1 that
//! episodes' programs reach (`MOULT_SANDBOX_URL`, relayed into their jails) with their lease's
//! token (`MOULT_SANDBOX_TOKEN`). An episode's first call claims its sandbox pod; every call is
//! sent on to that pod with the agents' key, which the program never sees; when the episode ends
//! its [`Lease`] is dropped and the pod released.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use rand::Rng;

use crate::claims::{Claimed, Claims};
use crate::server::MAX_BODY_BYTES;

/// The variables an episode's program gets: where to send its calls, and its token.
pub const URL_ENV: &str = "MOULT_SANDBOX_URL";
pub const TOKEN_ENV: &str = "MOULT_SANDBOX_TOKEN";

/// One episode's sandbox: not claimed until its first call.
#[derive(Debug, Default)]
struct Slot {
    image: Option<String>,
    claimed: tokio::sync::Mutex<Option<Claimed>>,
}

/// The episodes' way to their sandbox pods.
#[derive(Debug)]
pub struct Proxy {
    claims: Claims,
    /// The key sandbox pods check (the agents' credential).
    key: String,
    /// The port sandbox pods serve on.
    port: u16,
    /// This server's own address, `http://127.0.0.1:PORT`.
    url: String,
    http: reqwest::Client,
    slots: Mutex<HashMap<String, Arc<Slot>>>,
}

/// An episode's hold on its sandbox pod; dropping it releases the pod.
#[derive(Debug)]
pub struct Lease {
    proxy: Arc<Proxy>,
    token: String,
}

impl Proxy {
    /// A proxy at `url` (where [`Proxy::router`] is served) to sandbox pods of `claims` that
    /// serve on `port` and check `key`.
    pub fn new(claims: Claims, key: String, port: u16, url: String) -> Arc<Self> {
        Arc::new(Self {
            claims,
            key,
            port,
            url,
            http: reqwest::Client::new(),
            slots: Mutex::default(),
        })
    }

    /// A lease for one episode of `task`, whose sandbox pod runs the task's `image` (else the
    /// template's).
    pub fn lease(self: &Arc<Self>, task: &serde_json::Value) -> Lease {
        let image = task["image"].as_str().map(String::from);
        let token: String = (rand::thread_rng().sample_iter(rand::distributions::Alphanumeric))
            .take(32)
            .map(char::from)
            .collect();
        let slot = Arc::new(Slot {
            image,
            ..Slot::default()
        });
        self.slots
            .lock()
            .expect("slots")
            .insert(token.clone(), slot);
        Lease {
            proxy: self.clone(),
            token,
        }
    }

    pub fn router(self: Arc<Self>) -> Router {
        Router::new()
            .route("/run", post(forward))
            .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(self)
    }

    /// The episode's pod, claimed now if this is its first call. The claim is made by a task
    /// of its own, so a call given up half-way (its episode ended) still leaves the claim in
    /// the slot, where the lease's end finds and releases it.
    async fn pod(self: &Arc<Self>, slot: Arc<Slot>) -> Result<Claimed, String> {
        let proxy = self.clone();
        let claim = tokio::spawn(async move {
            let mut claimed = slot.claimed.lock().await;
            if claimed.is_none() {
                let started = std::time::Instant::now();
                let made = proxy.claims.claim(slot.image.as_deref()).await;
                let made = made.map_err(|e| e.to_string())?;
                let ms = started.elapsed().as_millis();
                let (what, address) = (&made.what, made.address);
                tracing::info!("claimed {what} ({address}) for an episode in {ms} ms");
                *claimed = Some(made);
            }
            Ok(claimed.clone().expect("claimed above"))
        });
        claim.await.map_err(|e| format!("claiming a pod: {e}"))?
    }
}

impl Lease {
    /// The variables of the episode's program.
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            (URL_ENV.into(), format!("{}/run", self.proxy.url)),
            (TOKEN_ENV.into(), self.token.clone()),
        ]
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let slot = self.proxy.slots.lock().expect("slots").remove(&self.token);
        let proxy = self.proxy.clone();
        if let (Some(slot), Ok(runtime)) = (slot, tokio::runtime::Handle::try_current()) {
            runtime.spawn(async move {
                if let Some(claimed) = slot.claimed.lock().await.take() {
                    proxy.claims.release(&claimed).await;
                    tracing::info!("released {}: its episode ended", claimed.what);
                }
            });
        }
    }
}

async fn forward(
    State(proxy): State<Arc<Proxy>>,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> Response {
    let token = headers.get("authorization").and_then(|v| v.to_str().ok());
    let token = token.and_then(|v| v.strip_prefix("Bearer ")).unwrap_or("");
    let slot = proxy.slots.lock().expect("slots").get(token).cloned();
    let Some(slot) = slot else {
        return (
            StatusCode::UNAUTHORIZED,
            format!("no running episode has this token ({TOKEN_ENV})"),
        )
            .into_response();
    };
    let pod = match proxy.pod(slot).await {
        Ok(pod) => pod,
        Err(why) => {
            return (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("no sandbox pod for this episode: {why}"),
            )
                .into_response()
        }
    };
    let url = format!(
        "http://{}/run",
        std::net::SocketAddr::new(pod.address, proxy.port)
    );
    let sent = proxy
        .http
        .post(&url)
        .bearer_auth(&proxy.key)
        .body(body)
        .send()
        .await;
    let answer = match sent {
        Ok(answer) => answer,
        Err(e) => {
            return (
                StatusCode::BAD_GATEWAY,
                format!("{} ({url}): {e}", pod.what),
            )
                .into_response()
        }
    };
    let status = StatusCode::from_u16(answer.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let kind = answer.headers().get("content-type").cloned();
    let kind = kind.unwrap_or(axum::http::HeaderValue::from_static("text/plain"));
    match answer.bytes().await {
        Ok(bytes) => (status, [("content-type", kind)], bytes).into_response(),
        Err(e) => (StatusCode::BAD_GATEWAY, format!("{}: {e}", pod.what)).into_response(),
    }
}
