//! Leader election on a `coordination.k8s.io/v1` Lease, as client-go's leaderelection does it:
//! a candidate takes the Lease when it is free or its holder has not renewed it for a lease
//! duration (measured on the candidate's own clock, from when it last saw the record change,
//! so clock skew between replicas does not matter); every write carries the resourceVersion it
//! read, so two candidates can never both succeed. Only the holder runs the controller.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::Client;

use crate::error::{Context, Result};

/// Lease timing: a holder renews every `renew`; others take over after `duration` without
/// renewal.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub duration: Duration,
    pub renew: Duration,
}

pub struct LeaseLock {
    api: Api<Lease>,
    name: String,
    identity: String,
    timing: Timing,
    /// resourceVersion last seen and when (local clock).
    observed: Option<(String, Instant)>,
}

impl LeaseLock {
    pub fn new(
        client: Client,
        namespace: &str,
        name: &str,
        identity: &str,
        timing: Timing,
    ) -> Self {
        LeaseLock {
            api: Api::namespaced(client, namespace),
            name: name.into(),
            identity: identity.into(),
            timing,
            observed: None,
        }
    }

    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// Takes or renews the lease; true when this candidate holds it afterwards.
    pub async fn try_acquire_or_renew(&mut self) -> Result<bool> {
        let now = MicroTime(Timestamp::now());
        let secs = i32::try_from(self.timing.duration.as_secs().max(1)).unwrap_or(i32::MAX);
        let Some(mut lease) = self
            .api
            .get_opt(&self.name)
            .await
            .context(|| format!("reading Lease {}", self.name))?
        else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.name.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(secs),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..LeaseSpec::default()
                }),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(l) => {
                    self.observe(&l);
                    Ok(true)
                }
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
                Err(e) => Err(e).context(|| format!("creating Lease {}", self.name)),
            };
        };
        let rv = lease.metadata.resource_version.clone().unwrap_or_default();
        if self.observed.as_ref().is_none_or(|(seen, _)| *seen != rv) {
            self.observed = Some((rv, Instant::now()));
        }
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let ours = holder.as_deref() == Some(self.identity.as_str());
        let held_for = spec
            .lease_duration_seconds
            .map_or(self.timing.duration, |s| {
                Duration::from_secs(s.max(0) as u64)
            });
        let expired = self
            .observed
            .as_ref()
            .is_some_and(|(_, at)| at.elapsed() > held_for);
        if !ours && holder.is_some() && !expired {
            return Ok(false);
        }
        if !ours {
            spec.holder_identity = Some(self.identity.clone());
            spec.acquire_time = Some(now.clone());
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.lease_duration_seconds = Some(secs);
        spec.renew_time = Some(now);
        // replace carries the resourceVersion read above: a concurrent writer makes it fail.
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(l) => {
                self.observe(&l);
                Ok(true)
            }
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e).context(|| format!("updating Lease {}", self.name)),
        }
    }

    /// Gives the lease up (on shutdown) so another replica need not wait for it to expire.
    pub async fn release(&mut self) -> Result<()> {
        let Some(mut lease) = self
            .api
            .get_opt(&self.name)
            .await
            .context(|| format!("reading Lease {}", self.name))?
        else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
        if spec.holder_identity.as_deref() != Some(self.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.lease_duration_seconds = Some(1);
        match self
            .api
            .replace(&self.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) | Err(kube::Error::Api(_)) => Ok(()),
            Err(e) => Err(e).context(|| format!("releasing Lease {}", self.name)),
        }
    }

    fn observe(&mut self, lease: &Lease) {
        self.observed = Some((
            lease.metadata.resource_version.clone().unwrap_or_default(),
            Instant::now(),
        ));
    }

    /// Retries until this candidate holds the lease.
    pub async fn acquire(&mut self) {
        loop {
            match self.try_acquire_or_renew().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "leader election: cannot reach the lease"),
            }
            tokio::time::sleep(self.timing.renew).await;
        }
    }

    /// Renews the lease every `renew` and returns when it is lost: a renewal was refused, or
    /// none succeeded for a lease duration (another replica may hold it by then).
    pub async fn hold(&mut self) {
        let mut last_ok = Instant::now();
        loop {
            tokio::time::sleep(self.timing.renew).await;
            match tokio::time::timeout(self.timing.renew, self.try_acquire_or_renew()).await {
                Ok(Ok(true)) => last_ok = Instant::now(),
                Ok(Ok(false)) => return,
                Ok(Err(e)) => tracing::warn!(error = %e, "leader election: renewal failed"),
                Err(_) => tracing::warn!("leader election: renewal timed out"),
            }
            // Stop well before others may take over (client-go's renew deadline).
            if last_ok.elapsed() >= self.timing.duration * 2 / 3 {
                return;
            }
        }
    }
}
