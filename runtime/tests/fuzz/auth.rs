//! The auth middleware on odd paths: percent-encoding, `//`, `.` and `..`, trailing slashes,
//! case, absolute URIs, queries, very long paths. Requests go through the real middleware in
//! front of the real router routes (the coordinator's own routes with the same patterns as
//! `cluster/coordinator.rs`), and a route layer reports which route axum matched. The agent
//! credential reaches only the agent routes (and the open probes) of the coordinator and nothing
//! of a router; no credential, or a wrong one, reaches only the probes; the run token is never
//! refused.

use std::cell::RefCell;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{MatchedPath, Request};
use axum::http::{HeaderValue, Method, StatusCode};
use axum::middleware::{from_fn, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use proptest::prelude::*;
use tower::ServiceExt;

use crate::{drive, Budget, Row, RUN_TOKEN};
use moult_runtime::router::{server, EnginePool, LeastOutstandingTokens, Router};

/// The coordinator's own routes (`cluster/coordinator.rs`), with the same patterns and methods.
fn coordinator_routes() -> axum::Router {
    let h = || async { StatusCode::OK };
    axum::Router::new()
        .route("/health", get(h))
        .route("/metrics", get(h))
        .route("/v1/status", get(h))
        .route("/v1/agents/lease", post(h))
        .route("/v1/agents/renew", post(h))
        .route("/v1/agents/episodes/{lease}", post(h))
        .route("/v1/trainer/hello", post(h))
        .route("/v1/trainer/batch", get(h))
        .route("/v1/trainer/version", post(h))
        .route("/v1/trainer/published", post(h))
        .route("/v1/trainer/commit", post(h))
}

/// Answers in place of the handler, naming the route axum matched.
async fn report(matched: Option<MatchedPath>, _req: Request, _next: Next) -> Response {
    let path = matched.map_or_else(|| "?".to_string(), |m| m.as_str().to_string());
    let mut r = StatusCode::IM_A_TEAPOT.into_response();
    r.headers_mut()
        .insert("x-matched", HeaderValue::from_str(&path).unwrap());
    r
}

struct Apps {
    coordinator: axum::Router,
    router: axum::Router,
    rt: tokio::runtime::Runtime,
}

fn apps() -> Apps {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _guard = rt.enter();
    let state = Arc::new(Router::new(
        Arc::new(EnginePool::new(&[])),
        Box::new(LeastOutstandingTokens),
    ));
    let coordinator = moult_runtime::auth::protect_for_agents(
        server::api_routes(state.clone())
            .merge(coordinator_routes())
            .route_layer(from_fn(report)),
        moult_runtime::auth::AgentGate::new([1 << 40, 1 << 40, 1 << 50]),
    );
    let router = moult_runtime::auth::protect(server::routes(state).route_layer(from_fn(report)));
    drop(_guard);
    Apps {
        coordinator,
        router,
        rt,
    }
}

thread_local! {
    static APPS: RefCell<Option<Apps>> = const { RefCell::new(None) };
}

const PATHS: [&str; 26] = [
    "/health",
    "/metrics",
    "/v1/status",
    "/v1/agents/lease",
    "/v1/agents/renew",
    "/v1/agents/episodes/lease-7",
    "/v1/trainer/hello",
    "/v1/trainer/batch",
    "/v1/trainer/version",
    "/v1/trainer/published",
    "/v1/trainer/commit",
    "/inference/v1/generate",
    "/inference/v1/abort_requests",
    "/pause",
    "/resume",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/collective_rpc",
    "/update_weight_version",
    "/init_weight_transfer_engine",
    "/is_paused",
    "/get_world_size",
    "/weight_info",
    "/v1/models",
    "/engines",
];

#[derive(Debug, Clone)]
enum Edit {
    DoubleSlash(prop::sample::Index),
    DotSegment(prop::sample::Index, &'static str),
    Append(&'static str),
    Prepend(&'static str),
    Percent(prop::sample::Index, bool),
    Upper(prop::sample::Index),
    Repeat(usize),
    Splice(prop::sample::Index, &'static str),
}

fn edit() -> impl Strategy<Value = Edit> {
    let piece = prop::sample::select(vec![
        "/",
        "//",
        "/.",
        "/..",
        "/../",
        "/./",
        "%2F",
        "%2f",
        "%2e%2e",
        "%2E",
        ";x",
        "\\",
        "?a=1",
        "#f",
        "/engines",
        "/../../engines",
        "/v1/trainer/commit",
        "/x",
        "%00",
        "é",
        "%",
        "%zz",
        "/lease-1",
        "+",
    ]);
    let dots = prop::sample::select(vec![".", "..", "", "%2e", "%2e%2e", ".%2e"]);
    prop_oneof![
        any::<prop::sample::Index>().prop_map(Edit::DoubleSlash),
        (any::<prop::sample::Index>(), dots).prop_map(|(i, d)| Edit::DotSegment(i, d)),
        piece.clone().prop_map(Edit::Append),
        prop::sample::select(vec!["http://coordinator", "//", "/.", "/..", "http://x:1"])
            .prop_map(Edit::Prepend),
        (any::<prop::sample::Index>(), any::<bool>()).prop_map(|(i, u)| Edit::Percent(i, u)),
        any::<prop::sample::Index>().prop_map(Edit::Upper),
        (2usize..2000).prop_map(Edit::Repeat),
        (any::<prop::sample::Index>(), piece).prop_map(|(i, p)| Edit::Splice(i, p)),
    ]
}

fn apply(path: &mut String, e: &Edit) {
    let boundary = |p: &String, i: &prop::sample::Index| {
        let mut at = i.index(p.len() + 1);
        while !p.is_char_boundary(at) {
            at -= 1;
        }
        at
    };
    match e {
        Edit::DoubleSlash(i) => {
            let slashes: Vec<usize> = path.match_indices('/').map(|(k, _)| k).collect();
            if !slashes.is_empty() {
                path.insert(slashes[i.index(slashes.len())], '/');
            }
        }
        Edit::DotSegment(i, d) => {
            let segs: Vec<&str> = path.split('/').collect();
            let k = i.index(segs.len());
            let mut segs: Vec<String> = segs.iter().map(|s| s.to_string()).collect();
            segs.insert(k.max(1), d.to_string());
            *path = segs.join("/");
        }
        Edit::Append(s) => path.push_str(s),
        Edit::Prepend(s) => path.insert_str(0, s),
        Edit::Percent(i, upper) => {
            let at = boundary(path, i);
            if let Some(c) = path[at..].chars().next() {
                if c.is_ascii() {
                    let enc = if *upper {
                        format!("%{:02X}", c as u8)
                    } else {
                        format!("%{:02x}", c as u8)
                    };
                    path.replace_range(at..at + 1, &enc);
                }
            }
        }
        Edit::Upper(i) => {
            let at = boundary(path, i);
            if let Some(c) = path[at..].chars().next() {
                if c.is_ascii_lowercase() {
                    path.replace_range(at..at + 1, &c.to_ascii_uppercase().to_string());
                }
            }
        }
        Edit::Repeat(n) => {
            let tail = path.rsplit('/').next().unwrap_or("").to_string();
            for _ in 0..*n {
                path.push('/');
                path.push_str(&tail);
            }
        }
        Edit::Splice(i, s) => {
            let at = boundary(path, i);
            path.insert_str(at, s);
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Credential {
    Run,
    Agent,
    None,
    Wrong,
    /// The agent credential in an odd spelling (extra spaces, lower-case scheme).
    AgentOdd(u8),
}

#[derive(Debug, Clone)]
struct Case {
    method: Method,
    path: String,
    edits: Vec<Edit>,
    credential: Credential,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec![
            Method::POST,
            Method::GET,
            Method::DELETE,
            Method::PUT,
            Method::HEAD,
            Method::OPTIONS,
            Method::PATCH,
        ]),
        prop_oneof![
            4 => prop::sample::select(PATHS.to_vec()).prop_map(str::to_string),
            1 => "(/[a-zA-Z0-9_.%-]{0,12}){0,5}",
        ],
        prop::collection::vec(edit(), 0..4),
        prop_oneof![
            1 => Just(Credential::Run),
            4 => Just(Credential::Agent),
            2 => Just(Credential::None),
            1 => Just(Credential::Wrong),
            1 => (0u8..4).prop_map(Credential::AgentOdd),
        ],
    )
        .prop_map(|(method, path, edits, credential)| Case {
            method,
            path,
            edits,
            credential,
        })
}

/// What a request got: `Some(route)` if it reached a route, `None` if refused or unrouted.
fn send(
    app: &axum::Router,
    rt: &tokio::runtime::Runtime,
    req: Request,
) -> (StatusCode, Option<String>) {
    let response = rt.block_on(app.clone().oneshot(req)).unwrap();
    let matched = response
        .headers()
        .get("x-matched")
        .map(|v| v.to_str().unwrap().to_string());
    (response.status(), matched)
}

fn agent_route(method: &Method, route: &str) -> bool {
    *method == Method::POST
        && matches!(
            route,
            "/v1/agents/lease"
                | "/v1/agents/renew"
                | "/v1/agents/episodes/{lease}"
                | "/inference/v1/generate"
                | "/inference/v1/abort_requests"
        )
}

/// The probes are open to any method (their routes answer 405 to all but GET and HEAD).
fn open_route(route: &str) -> bool {
    matches!(route, "/health" | "/metrics")
}

fn check(case: Case) -> Result<(), TestCaseError> {
    let mut path = case.path.clone();
    for e in &case.edits {
        apply(&mut path, e);
    }
    let agent = moult_runtime::auth::agent_token().expect("derived from the run token");
    let authorization = match case.credential {
        Credential::Run => Some(format!("Bearer {RUN_TOKEN}")),
        Credential::Agent => Some(format!("Bearer {agent}")),
        Credential::None => None,
        Credential::Wrong => Some("Bearer guess".to_string()),
        Credential::AgentOdd(0) => Some(format!("Bearer  {agent} ")),
        Credential::AgentOdd(1) => Some(format!("bearer {agent}")),
        Credential::AgentOdd(2) => Some(format!("Bearer {agent}, Bearer {RUN_TOKEN}")),
        Credential::AgentOdd(_) => Some(format!("Bearer {}", &agent[..agent.len() - 1])),
    };
    let build = || {
        let mut b = Request::builder()
            .method(case.method.clone())
            .uri(path.as_str());
        if let Some(a) = &authorization {
            b = b.header("authorization", a.as_str());
        }
        b.body(Body::empty())
    };
    // A request line hyper would not parse never reaches the middleware.
    let Ok(_) = build() else {
        return Ok(());
    };
    APPS.with(|apps| {
        let mut apps = apps.borrow_mut();
        let apps = apps.get_or_insert_with(self::apps);
        for (app, coordinator) in [(&apps.coordinator, true), (&apps.router, false)] {
            let (status, matched) = send(app, &apps.rt, build().unwrap());
            let reached = matched.as_deref();
            match (case.credential, reached) {
                (_, None) => {
                    // Refused, or no such route: never a refusal of the run token.
                    if case.credential == Credential::Run {
                        prop_assert!(
                            status != StatusCode::UNAUTHORIZED && status != StatusCode::FORBIDDEN,
                            "the run token was refused on {} {path}",
                            case.method
                        );
                    }
                }
                (Credential::Run, Some(_)) => {}
                (Credential::Agent | Credential::AgentOdd(0), Some(route)) => prop_assert!(
                    open_route(route) || (coordinator && agent_route(&case.method, route)),
                    "the agent credential opened {} {route} (as {path}) on the {}",
                    case.method,
                    if coordinator { "coordinator" } else { "router" }
                ),
                (_, Some(route)) => prop_assert!(
                    open_route(route),
                    "{:?} opened {} {route} (as {path})",
                    case.credential,
                    case.method
                ),
            }
        }
        Ok(())
    })
}

pub fn target(budget: Budget) -> Row {
    drive("auth_paths", budget, 3000, case(), check)
}
