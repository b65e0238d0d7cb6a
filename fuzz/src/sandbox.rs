//! The agent sandbox's socket protocol from the side of `moult agents`, which holds the run's
//! credentials: the sandbox container runs agent code, so what it answers is untrusted
//! (docs/security.md, "Agent pods").

use std::path::PathBuf;
use std::time::Duration;

use moult_jail::sandbox::Sandboxed;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixListener;

thread_local! {
    static SOCKET: (PathBuf, UnixListener) = {
        let dir = std::env::temp_dir().join(format!("moult-fuzz-sandbox-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        let path = dir.join("sandbox.sock");
        let _ = std::fs::remove_file(&path);
        let listener = crate::block_on(async { UnixListener::bind(&path) }).expect("bind");
        (path, listener)
    };
}

/// A sandbox that answers a start with these bytes, then closes: the agents' side reports a
/// start and an exit, or fails with a message, and never hangs or panics.
pub fn client(data: &[u8]) {
    SOCKET.with(|(path, listener)| {
        crate::block_on(async {
            let sandbox = async {
                let (mut conn, _) = listener.accept().await.expect("accept");
                // The start request (descriptors and a JSON line) is read and ignored.
                let mut request = [0u8; 4096];
                let _ =
                    tokio::time::timeout(Duration::from_millis(100), conn.read(&mut request)).await;
                let _ = conn.write_all(data).await;
                let _ = conn.shutdown().await;
                conn
            };
            let agents = async {
                let mut started = Sandboxed::spawn(path, "true", &[], Vec::new(), None)
                    .await
                    .ok()?;
                started.wait().await.ok()
            };
            let run = async { tokio::join!(sandbox, agents) };
            tokio::time::timeout(Duration::from_secs(10), run)
                .await
                .expect("the agents' side hung on the sandbox's answer");
        })
    })
}
