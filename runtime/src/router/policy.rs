//! Routing policies: which healthy engine gets a request. A policy sees only engines that are up
//! (health filtering happens once, in the pool) and never an empty list.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use super::pool::Engine;

/// What a policy knows about a request.
#[derive(Debug, Clone, Copy)]
pub struct RouteRequest<'a> {
    /// The session (episode) the request belongs to, if the client named one.
    pub session: Option<&'a str>,
    /// Prompt tokens plus the most the request may generate.
    pub tokens: u64,
}

/// Picks an engine for a request among `engines` (healthy, non-empty).
pub trait RoutingPolicy: Send + Sync + std::fmt::Debug {
    fn pick(&self, request: &RouteRequest<'_>, engines: &[Arc<Engine>]) -> usize;
}

/// The engine with the fewest tokens outstanding (ties: fewest requests, then first).
#[derive(Debug, Default)]
pub struct LeastOutstandingTokens;

impl RoutingPolicy for LeastOutstandingTokens {
    fn pick(&self, _request: &RouteRequest<'_>, engines: &[Arc<Engine>]) -> usize {
        (0..engines.len())
            .min_by_key(|&i| (engines[i].tokens(), engines[i].requests()))
            .expect("a policy is never given an empty list")
    }
}

/// Consistent hashing on the session id with bounded load: every turn of an episode lands on
/// the engine that holds its prefix cache, unless that engine carries more than `1 + epsilon`
/// times the average load, in which case the session's next engine in its own order takes it.
///
/// The order is rendezvous (highest-random-weight) hashing, score = hash(session, engine URL):
/// when an engine joins or leaves, only the sessions that ranked it first move (Thaler & Ravishankar
/// 1998; the load bound after Mirrokni, Thorup & Zadimoghaddam 2018). Requests without a session
/// go to the least loaded engine.
#[derive(Debug)]
pub struct ConsistentHash {
    pub epsilon: f64,
}

impl Default for ConsistentHash {
    fn default() -> Self {
        Self { epsilon: 0.25 }
    }
}

fn score(session: &str, url: &str) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    session.hash(&mut h);
    url.hash(&mut h);
    h.finish()
}

impl RoutingPolicy for ConsistentHash {
    fn pick(&self, request: &RouteRequest<'_>, engines: &[Arc<Engine>]) -> usize {
        let Some(session) = request.session else {
            return LeastOutstandingTokens.pick(request, engines);
        };
        let mut order: Vec<usize> = (0..engines.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(score(session, engines[i].url())));
        // Load in requests, counting this one: bound = ceil((1 + eps) * average).
        let total: u64 = engines.iter().map(|e| e.requests()).sum::<u64>() + 1;
        let bound = ((1.0 + self.epsilon) * total as f64 / engines.len() as f64).ceil() as u64;
        order
            .iter()
            .copied()
            .find(|&i| engines[i].requests() < bound.max(1))
            .unwrap_or(order[0])
    }
}

/// A policy by name: `consistent-hash` (default) or `least-tokens`.
pub fn by_name(name: &str) -> Option<Box<dyn RoutingPolicy>> {
    match name {
        "consistent-hash" => Some(Box::new(ConsistentHash::default())),
        "least-tokens" => Some(Box::new(LeastOutstandingTokens)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::pool::EnginePool;
    use super::*;

    fn pool(n: usize) -> EnginePool {
        let urls: Vec<String> = (0..n).map(|i| format!("http://e{i}:8000")).collect();
        EnginePool::new(&urls)
    }

    #[test]
    fn sessions_stick_and_only_a_leaving_engines_sessions_move() {
        let p = pool(4);
        let engines = p.all();
        let policy = ConsistentHash::default();
        let pick = |s: &str, engines: &[Arc<Engine>]| {
            engines[policy.pick(
                &RouteRequest {
                    session: Some(s),
                    tokens: 10,
                },
                engines,
            )]
            .url()
            .to_string()
        };
        let sessions: Vec<String> = (0..200).map(|i| format!("ep{i}")).collect();
        let before: Vec<String> = sessions.iter().map(|s| pick(s, &engines)).collect();
        assert_eq!(
            before,
            sessions
                .iter()
                .map(|s| pick(s, &engines))
                .collect::<Vec<_>>()
        );
        // Every engine gets some sessions.
        for e in &engines {
            assert!(before.iter().any(|u| u == e.url()));
        }
        let fewer: Vec<Arc<Engine>> = engines[1..].to_vec();
        for (s, b) in sessions.iter().zip(&before) {
            if b != engines[0].url() {
                assert_eq!(&pick(s, &fewer), b, "{s} moved although its engine stayed");
            }
        }
    }

    #[test]
    fn an_overloaded_engine_spills_to_the_next() {
        let p = pool(2);
        let engines = p.all();
        let policy = ConsistentHash::default();
        let req = RouteRequest {
            session: Some("s"),
            tokens: 10,
        };
        let first = policy.pick(&req, &engines);
        let _load: Vec<_> = (0..10).map(|_| engines[first].track(10)).collect();
        assert_ne!(policy.pick(&req, &engines), first);
    }

    #[test]
    fn least_tokens_picks_the_emptiest() {
        let p = pool(3);
        let engines = p.all();
        let _a = engines[0].track(500);
        let _b = engines[2].track(100);
        let req = RouteRequest {
            session: None,
            tokens: 10,
        };
        assert_eq!(LeastOutstandingTokens.pick(&req, &engines), 1);
        assert!(by_name("nope").is_none());
    }
}
