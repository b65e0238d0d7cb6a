//! A sandbox pod's server over HTTP, as the agents' proxy calls it: only the key whose hash it
//! holds opens it, the calls of an episode share its workspace, a call's files stay inside it,
//! and a call's time is bounded. (Its calls run in process groups here; jails in sandbox pods
//! are run by the cluster test, runtime/tests/cluster_run.rs.)

use std::collections::BTreeMap;
use std::sync::Arc;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use moult_jail::Limits;
use moult_sandbox_pods::server::{RunRequest, RunResult, Server};

fn request(argv: &[&str], files: &[(&str, &str)]) -> RunRequest {
    RunRequest {
        argv: argv.iter().map(|a| a.to_string()).collect(),
        files: (files.iter())
            .map(|(name, text)| (name.to_string(), BASE64.encode(text)))
            .collect::<BTreeMap<_, _>>(),
        stdin: BASE64.encode("from stdin"),
        timeout: 5.0,
        limits: Limits::default(),
        env: vec![("GREETING".into(), "hello".into())],
        max_output: 1 << 20,
        max_files_bytes: 1 << 20,
    }
}

#[tokio::test]
async fn the_server_runs_its_episodes_calls_for_the_key_it_knows_and_no_other() {
    let root = std::env::temp_dir().join(format!("moult-sandbox-server-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let verifier = moult_operator::children::verifier("the-key");
    let server = Server::new(
        &verifier,
        root.join("workspace"),
        root.join("streams"),
        false,
    );
    let server = Arc::new(server.expect("a server"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/run", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, server.router()).await });
    let http = reqwest::Client::new();
    let call = |key: &'static str, body: RunRequest| {
        let sent = http.post(&url).bearer_auth(key).json(&body).send();
        async move {
            let answer = sent.await.expect("the server answers");
            (answer.status().as_u16(), answer.text().await.unwrap())
        }
    };

    // A call writes a file and reads its stdin, its variables and a file it was given.
    let script = "cat; echo; echo $GREETING; cat given.txt; mkdir out; echo made > out/made.txt";
    let (status, body) = call(
        "the-key",
        request(&["sh", "-c", script], &[("given.txt", "given\n")]),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let result: RunResult = serde_json::from_str(&body).unwrap();
    assert_eq!(result.stdout, "from stdin\nhello\ngiven\n");
    assert_eq!((result.exit_code, result.timed_out), (Some(0), false));
    let made: Vec<&String> = result.files.keys().collect();
    assert_eq!(
        made,
        ["out/made.txt"],
        "only what the call wrote comes back"
    );
    assert_eq!(
        BASE64.decode(&result.files["out/made.txt"]).unwrap(),
        b"made\n"
    );

    // The next call of the episode finds the workspace as the last one left it.
    let (_, body) = call(
        "the-key",
        request(&["cat", "out/made.txt", "given.txt"], &[]),
    )
    .await;
    let result: RunResult = serde_json::from_str(&body).unwrap();
    assert_eq!(result.stdout, "made\ngiven\n");

    // A call that runs too long is ended, with all it started.
    let mut slow = request(&["sh", "-c", "sleep 30 & sleep 30"], &[]);
    slow.timeout = 0.5;
    let (_, body) = call("the-key", slow).await;
    let result: RunResult = serde_json::from_str(&body).unwrap();
    assert!(result.timed_out && result.exit_code.is_none(), "{body}");

    // Files outside the workspace, another key, no key: refused, and nothing written.
    let (status, body) = call("the-key", request(&["true"], &[("../escaped.txt", "x")])).await;
    assert_eq!(status, 400, "{body}");
    assert!(!root.join("escaped.txt").exists());
    let (status, _) = call("another-key", request(&["touch", "forged"], &[])).await;
    assert_eq!(status, 401);
    let answer = http
        .post(&url)
        .json(&request(&["touch", "forged"], &[]))
        .send()
        .await;
    assert_eq!(answer.unwrap().status().as_u16(), 401);
    assert!(!root.join("workspace/forged").exists());
    let _ = std::fs::remove_dir_all(&root);
}
