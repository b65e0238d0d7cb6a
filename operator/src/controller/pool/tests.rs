//! What a run may take from its pool, which runs a pool lists, its finalizer and its status
//! (pure parts of the EnginePool controller).

use k8s_openapi::api::apps::v1::{StatefulSet, StatefulSetStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{ApiResource, DynamicObject};

use super::*;
use crate::api::{EnginePool, RLRun, RunPoolStatus};
use crate::children::tests::pool_example;

fn now() -> Time {
    Time(Timestamp::from_second(1_800_000_000).unwrap())
}

fn pool() -> EnginePool {
    pool_example().0
}

fn run(name: &str) -> RLRun {
    let (_, runs) = pool_example();
    runs.into_iter()
        .find(|r| r.metadata.name.as_deref() == Some(name))
        .unwrap()
}

#[test]
fn a_run_takes_its_credential_from_an_existing_pool_with_its_model() {
    let r = run("gsm8k-lora-a");
    let (on, issue) = judge(&r, "qwen3-8b", Some(&pool()), Some("pool-token"));
    assert_eq!(issue, None);
    let on = on.unwrap();
    assert_eq!(on.name, "qwen3-8b");
    assert_eq!(
        crate::credentials::pool_run("pool-token", &on.credential),
        Some("gsm8k-lora-a")
    );
}

#[test]
fn what_keeps_a_run_from_its_pool_is_named_by_reason() {
    let r = run("gsm8k-lora-a");
    let reason = |pool: Option<&EnginePool>, token: Option<&str>| {
        let (on, issue) = judge(&r, "qwen3-8b", pool, token);
        (on.is_some(), issue.map(|i| (i.reason, i.message)))
    };
    let (usable, issue) = reason(None, None);
    let (why, message) = issue.unwrap();
    assert!(!usable);
    assert_eq!(why, POOL_NOT_FOUND);
    assert!(message.contains("the EnginePool qwen3-8b does not exist in namespace research"));

    let mut other = pool();
    other.spec.model.path = "Llama-3-8B".into();
    let (usable, issue) = reason(Some(&other), Some("t"));
    let (why, message) = issue.unwrap();
    assert!(!usable, "no run trains an adapter of another base");
    assert_eq!(why, POOL_MODEL_MISMATCH);
    assert!(
        message.contains("(Qwen3-8B on claim models) is not the base model of the EnginePool qwen3-8b (Llama-3-8B on claim models)"),
        "{message}"
    );

    let mut small = pool();
    small.spec.max_rank = 8;
    let (usable, issue) = reason(Some(&small), Some("t"));
    assert!(!usable);
    assert_eq!(issue.unwrap().0, POOL_RANK_TOO_LARGE);

    let (usable, issue) = reason(Some(&pool()), None);
    assert!(!usable, "no credential without the pool's token");
    assert_eq!(issue.unwrap().0, POOL_NOT_READY);

    let mut deleting = pool();
    deleting.metadata.deletion_timestamp = Some(now());
    let (usable, issue) = reason(Some(&deleting), Some("t"));
    assert!(usable, "a pool being deleted still serves its runs");
    let (why, message) = issue.unwrap();
    assert_eq!(why, POOL_DELETING);
    assert!(message.contains("until no run names it"), "{message}");
}

fn listed(name: &str, pool: Option<&str>, share: Option<f64>) -> DynamicObject {
    let mut o = DynamicObject::new(name, &ApiResource::erase::<RLRun>(&()));
    o.data = serde_json::json!({
        "spec": {"engines": pool.map(|p| serde_json::json!({"poolRef": {"name": p}})).unwrap_or_default()},
        "status": {"pool": share.map(|s| serde_json::json!({"name": pool, "share": s}))},
    });
    o
}

#[test]
fn a_pool_lists_the_runs_that_name_it_with_their_shares() {
    let runs = [
        listed("b", Some("shared"), None),
        listed("a", Some("shared"), Some(0.25)),
        listed("own-engines", None, None),
        listed("elsewhere", Some("other"), Some(1.0)),
    ];
    assert_eq!(
        runs_on("shared", &runs),
        [
            PoolRun {
                name: "a".into(),
                share: Some(0.25)
            },
            PoolRun {
                name: "b".into(),
                share: None
            },
        ]
    );
    assert_eq!(runs_on("nobody", &runs), []);
}

#[test]
fn the_finalizer_is_held_while_runs_name_the_pool_and_only_then() {
    let ours = POOL_FINALIZER.to_string();
    let other = "example.com/backup".to_string();
    assert_eq!(
        finalizers(std::slice::from_ref(&other), true, false),
        Some(vec![other.clone(), ours.clone()])
    );
    assert_eq!(finalizers(std::slice::from_ref(&ours), true, false), None);
    assert_eq!(
        finalizers(std::slice::from_ref(&ours), true, true),
        None,
        "kept while runs name it"
    );
    assert_eq!(
        finalizers(&[other.clone(), ours.clone()], false, true),
        Some(vec![other.clone()])
    );
    assert_eq!(finalizers(&[ours], false, false), Some(vec![]));
    assert_eq!(finalizers(&[], false, false), None);
    assert_eq!(
        finalizers(&[], true, true),
        None,
        "a pool being deleted takes no new finalizer"
    );
}

fn engines(desired: i32, ready: i32) -> StatefulSet {
    let mut s = crate::children::pool_desired(&pool(), &Default::default(), "t")
        .unwrap()
        .engines;
    s.spec.replicas = Some(desired);
    s.metadata.generation = Some(1);
    s.status = Some(StatefulSetStatus {
        observed_generation: Some(1),
        replicas: desired,
        ready_replicas: Some(ready),
        updated_replicas: Some(desired),
        ..Default::default()
    });
    s
}

fn condition<'a>(
    s: &'a crate::api::EnginePoolStatus,
    t: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    s.conditions.iter().find(|c| c.type_ == t)
}

#[test]
fn a_pool_is_ready_when_its_engines_are_and_reports_them_for_the_scale_subresource() {
    let p = pool();
    let runs = vec![PoolRun {
        name: "gsm8k-lora-a".into(),
        share: Some(0.5),
    }];
    let s = pool_status(&p, Some(&engines(2, 2)), &[], runs.clone(), None, &now());
    assert_eq!(s.replicas, 2);
    assert_eq!(s.ready.as_deref(), Some("2/2"));
    assert_eq!(
        s.selector.as_deref(),
        Some("moult.dev/component=engine,moult.dev/pool=qwen3-8b")
    );
    assert_eq!(s.runs, runs);
    let ready = condition(&s, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "EnginesReady")
    );
    assert!(condition(&s, "Deleting").is_none());

    let s = pool_status(&p, Some(&engines(2, 1)), &[], vec![], None, &now());
    assert_eq!(s.replicas, 1);
    let ready = condition(&s, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "EnginesNotReady")
    );
    assert_eq!(ready.message, "waiting for engines 1/2 ready");

    let s = pool_status(
        &p,
        None,
        &[],
        vec![],
        Some("Secret qwen3-8b-pool already exists"),
        &now(),
    );
    let ready = condition(&s, "Ready").unwrap();
    assert_eq!(ready.reason, "InvalidSpec");
    assert!(ready.message.contains("qwen3-8b-pool"));
}

#[test]
fn a_deleted_pool_names_the_runs_it_waits_for() {
    let mut p = pool();
    p.metadata.deletion_timestamp = Some(now());
    let runs = vec![
        PoolRun {
            name: "gsm8k-lora-a".into(),
            share: None,
        },
        PoolRun {
            name: "gsm8k-lora-b".into(),
            share: None,
        },
    ];
    let s = pool_status(&p, Some(&engines(2, 2)), &[], runs, None, &now());
    // `kubectl get enginepools` prints every run, not the first of the list.
    assert_eq!(s.run_names.as_deref(), Some("gsm8k-lora-a,gsm8k-lora-b"));
    let deleting = condition(&s, "Deleting").unwrap();
    assert_eq!(
        (deleting.status.as_str(), deleting.reason.as_str()),
        ("True", "RunsOnPool")
    );
    assert!(
        deleting
            .message
            .contains("runs on it: gsm8k-lora-a, gsm8k-lora-b"),
        "{}",
        deleting.message
    );
    let s = pool_status(&p, Some(&engines(2, 2)), &[], vec![], None, &now());
    assert_eq!(condition(&s, "Deleting").unwrap().reason, "NoRuns");
    assert_eq!(s.run_names, None);
}

#[test]
fn a_run_on_a_pool_reports_the_pool_and_its_reason() {
    use crate::controller::status::{compute, Refusal, Workloads};
    let mut r = run("gsm8k-lora-a");
    r.metadata.generation = Some(1);
    let refusal = Refusal::Pool {
        reason: POOL_NOT_FOUND,
        message: "spec.engines.poolRef: the EnginePool qwen3-8b does not exist".into(),
    };
    let s = compute(&r, &Workloads::default(), Some(&refusal), &now());
    let ready = s.conditions.iter().find(|c| c.type_ == "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", POOL_NOT_FOUND)
    );
    assert_eq!(s.phase, Some(crate::api::Phase::Pending));
    assert_eq!(
        s.pool,
        Some(RunPoolStatus {
            name: "qwen3-8b".into(),
            share: None
        })
    );
    // The run's engines are the pool's.
    let w = Workloads {
        engines: Some(engines(2, 2)),
        ..Workloads::default()
    };
    let s = compute(&r, &w, None, &now());
    let e = s.engines.unwrap();
    assert_eq!(e.ready, "2/2");
    assert_eq!(
        e.selector,
        "moult.dev/component=engine,moult.dev/pool=qwen3-8b"
    );
}

#[test]
fn the_operator_writes_the_pool_name_never_the_coordinators_share() {
    use crate::controller::status::{changed, compute, Workloads};
    let mut r = run("gsm8k-lora-a");
    r.metadata.generation = Some(1);
    let new = compute(&r, &Workloads::default(), None, &now());
    let mut old = new.clone();
    // The coordinator's share is not the operator's to write: no status write for it.
    old.pool.as_mut().unwrap().share = Some(0.4);
    assert!(!changed(Some(&old), &new));
    assert_eq!(
        serde_json::to_value(&new).unwrap()["pool"],
        serde_json::json!({"name": "qwen3-8b"}),
        "the operator's apply carries no share"
    );
    // A run moved to another pool is.
    old.pool.as_mut().unwrap().name = "other".into();
    assert!(changed(Some(&old), &new));
}
