//! Hostile programs, each in a jail of its own (docs/security.md, "Episodes"): each is contained,
//! names the limit it hit where it hit one, and leaves nothing behind for the next jail.
//!
//! The test binary is the jails' `moult` too: started with `MOULT_JAIL`, it makes the jail.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::{Duration, Instant};

use moult_jail::{Jail, Limits};

/// How a jailed program ended, and what it wrote.
struct Ran {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn signal(&self) -> Option<i32> {
        std::os::unix::process::ExitStatusExt::signal(&self.status)
    }
}

/// Runs `script` with `sh -c` in `jail`, killed after `wall` (the episode's timeout).
async fn jailed(jail: &Jail, script: &str, wall: Duration) -> Ran {
    let args = ["-c".to_string(), script.to_string()];
    let env = vec![("PATH".to_string(), std::env::var("PATH").unwrap())];
    let wrapped = jail.wrap("/bin/sh", &args, env).expect("wraps");
    let child = tokio::process::Command::new(&wrapped.program)
        .args(&wrapped.args)
        .env_clear()
        .envs(wrapped.env)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(wall, child).await;
    let out = match out {
        Ok(out) => out.expect("the jail starts"),
        Err(_) => panic!("the jail outlived its wall clock: {script}"),
    };
    Ran {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).trim().to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    }
}

const WALL: Duration = Duration::from_secs(60);

/// Processes on this machine whose command line holds `marker`.
fn processes_with(marker: &str) -> usize {
    let entries = std::fs::read_dir("/proc").unwrap();
    entries
        .filter_map(|e| std::fs::read(e.ok()?.path().join("cmdline")).ok())
        .filter(|cmdline| String::from_utf8_lossy(cmdline).contains(marker))
        .count()
}

fn scratch_folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("moult-hostile-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn runs_and_reports_its_exit() {
    let ran = jailed(&Jail::default(), "echo hello; echo oops >&2; exit 3", WALL).await;
    assert_eq!(
        (ran.stdout.as_str(), ran.stderr.as_str()),
        ("hello", "oops")
    );
    assert_eq!(ran.status.code(), Some(3));
    let ran = jailed(&Jail::default(), "kill -TERM $$", WALL).await;
    assert_eq!(ran.signal(), Some(15), "{}", ran.stderr);
    // The jail's `moult` starts with this process's library path (a build linked to libtorch
    // needs it); the program gets exactly the variables it was given.
    let ran = jailed(&Jail::default(), "echo ${LD_LIBRARY_PATH-unset}", WALL).await;
    assert_eq!(ran.stdout, "unset", "{}", ran.stderr);
}

async fn a_setsid_daemon_dies_with_its_episode() {
    let marker = format!("moult-daemon-{}", std::process::id());
    let script = format!("setsid sh -c 'sleep 1000; : {marker}' > /dev/null 2>&1 < /dev/null & sleep 0.5; echo started");
    let ran = jailed(&Jail::default(), &script, WALL).await;
    assert_eq!(ran.stdout, "started", "{}", ran.stderr);
    // The kernel kills what is left in the jail's PID namespace as the jail's first process exits.
    let deadline = Instant::now() + Duration::from_secs(5);
    while processes_with(&marker) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        processes_with(&marker),
        0,
        "the daemon outlived its episode"
    );
}

async fn a_fork_bomb_meets_the_process_limit_and_dies_with_its_episode() {
    let jail = Jail {
        limits: Limits {
            processes: 32,
            ..Limits::default()
        },
        ..Jail::default()
    };
    let marker = format!("moult-bomb-{}", std::process::id());
    // Forks until it cannot, every child forking too; the episode's timeout ends it.
    let script = format!("b() {{ b & b & wait; }}; b; : {marker}");
    let args = ["-c".to_string(), script];
    let env = vec![("PATH".to_string(), std::env::var("PATH").unwrap())];
    let wrapped = jail.wrap("/bin/sh", &args, env).unwrap();
    let mut child = tokio::process::Command::new(&wrapped.program)
        .args(&wrapped.args)
        .env_clear()
        .envs(wrapped.env)
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        processes_with(&marker) <= 40,
        "{} processes",
        processes_with(&marker)
    );
    // The episode's timeout kills the keeper: the jail goes with it.
    child.kill().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while processes_with(&marker) > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(processes_with(&marker), 0, "the bomb outlived its episode");
    // This machine can still start processes.
    assert!(std::process::Command::new("true")
        .status()
        .unwrap()
        .success());
}

async fn a_memory_hog_is_refused_and_named() {
    let limits = Limits {
        memory_bytes: 256 << 20,
        ..Limits::default()
    };
    let jail = Jail {
        limits,
        ..Jail::default()
    };
    let ran = jailed(&jail, "python3 -c 'x = bytearray(1 << 30)'", WALL).await;
    assert!(!ran.status.success());
    assert_eq!(
        limits.hit(ran.signal(), &ran.stderr).as_deref(),
        Some("agent.limits.memory = 256Mi"),
        "{}",
        ran.stderr
    );
}

/// Processes that each stay within the address-space limit but together hold more than it: where
/// the jail has a memory cgroup (a jail made by root, with cgroup v1's memory controller
/// writable), the kernel kills one of them and the failure names the limit.
async fn processes_that_together_hog_memory_meet_the_jails_memory_limit() {
    let memory = std::path::Path::new("/sys/fs/cgroup/memory");
    let writable = nix::unistd::access(memory, nix::unistd::AccessFlags::W_OK).is_ok();
    if !nix::unistd::getuid().is_root() || !writable {
        println!("    (no memory cgroup for this user here: each process's address space is the bound, docs/security.md#still-open)");
        return;
    }
    let limits = Limits {
        memory_bytes: 256 << 20,
        ..Limits::default()
    };
    let jail = Jail {
        limits,
        ..Jail::default()
    };
    // Four processes of 150 MiB each, every page written.
    let script = "python3 -c '
import os, sys, time
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        x = bytearray(b\"x\") * (150 << 20)
        time.sleep(3)
        os._exit(0)
    kids.append(pid)
sys.exit(any(os.waitpid(k, 0)[1] for k in kids))
'";
    let ran = jailed(&jail, script, WALL).await;
    assert!(!ran.status.success(), "{}", ran.stderr);
    assert_eq!(
        limits.hit(ran.signal(), &ran.stderr).as_deref(),
        Some("agent.limits.memory = 256Mi"),
        "{}",
        ran.stderr
    );
}

async fn an_infinite_loop_meets_the_cpu_limit_and_is_named() {
    let limits = Limits {
        cpu_seconds: 1,
        ..Limits::default()
    };
    let jail = Jail {
        limits,
        ..Jail::default()
    };
    let ran = jailed(&jail, "exec python3 -c 'while True: pass'", WALL).await;
    assert_eq!(ran.signal(), Some(libc::SIGXCPU), "{}", ran.stderr);
    assert_eq!(
        limits.hit(ran.signal(), &ran.stderr).as_deref(),
        Some("agent.limits.cpuSeconds = 1")
    );
}

async fn a_disk_filler_meets_the_scratch_and_file_limits() {
    let limits = Limits {
        scratch_bytes: 8 << 20,
        file_size_bytes: 4 << 20,
        ..Limits::default()
    };
    let jail = Jail {
        limits,
        ..Jail::default()
    };
    let ran = jailed(
        &jail,
        "exec dd if=/dev/zero of=/tmp/big bs=1M count=64",
        WALL,
    )
    .await;
    assert_eq!(ran.signal(), Some(libc::SIGXFSZ), "{}", ran.stderr);
    assert_eq!(
        limits.hit(ran.signal(), &ran.stderr).as_deref(),
        Some("agent.limits.fileSize = 4Mi")
    );
    let ran = jailed(
        &jail,
        "for i in 1 2 3 4; do dd if=/dev/zero of=/tmp/f$i bs=1M count=3 || exit 1; done",
        WALL,
    )
    .await;
    assert_eq!(ran.status.code(), Some(1));
    assert_eq!(
        limits.hit(ran.signal(), &ran.stderr).as_deref(),
        Some("agent.limits.scratch = 8Mi"),
        "{}",
        ran.stderr
    );
}

async fn kept_code_is_read_only_and_scratch_is_private() {
    let code = scratch_folder("code");
    std::fs::write(code.join("agent.py"), "print('agent')\n").unwrap();
    let result = scratch_folder("result");
    let jail = Jail {
        readable: vec![code.clone()],
        writable: vec![result.clone()],
        ..Jail::default()
    };
    let script = format!(
        "cat {code}/agent.py; echo tampered >> {code}/agent.py || echo refused; \
         echo x > /usr/moult-test || echo refused; echo secret > /tmp/left-behind; \
         echo result > {result}/out; ls /tmp",
        code = code.display(),
        result = result.display(),
    );
    let ran = jailed(&jail, &script, WALL).await;
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(
        lines[..3],
        ["print('agent')", "refused", "refused"],
        "{}",
        ran.stderr
    );
    assert_eq!(
        std::fs::read_to_string(code.join("agent.py")).unwrap(),
        "print('agent')\n"
    );
    assert_eq!(
        std::fs::read_to_string(result.join("out")).unwrap(),
        "result\n"
    );
    // Only what the jail holds is in its /tmp: not this machine's /tmp, not another jail's.
    assert!(!Path::new("/tmp/left-behind").exists());
    let ran = jailed(&jail, "cat /tmp/left-behind || echo gone", WALL).await;
    assert_eq!(ran.stdout, "gone");
    // A file named through `..` from a kept folder (a test's cwd `runtime/`, its agent
    // `runtime/../examples/env.py`, in a checkout under /tmp) is kept too.
    let sibling = scratch_folder("sibling");
    std::fs::write(sibling.join("env.py"), "print('env')\n").unwrap();
    let through = (code.join("..").join(sibling.file_name().unwrap())).join("env.py");
    let jail = Jail {
        readable: vec![code.clone(), through.clone()],
        ..Jail::default()
    };
    let ran = jailed(&jail, &format!("cat {}", through.display()), WALL).await;
    assert_eq!(ran.stdout, "print('env')", "{}", ran.stderr);
}

async fn another_episode_is_out_of_sight() {
    let marker = format!("moult-neighbour-{}", std::process::id());
    let neighbour = Jail::default();
    let script =
        format!("echo secret > /tmp/mine; exec python3 -c 'import time; time.sleep(30)' {marker}");
    let args = ["-c".to_string(), script];
    let env = vec![("PATH".to_string(), std::env::var("PATH").unwrap())];
    let wrapped = neighbour.wrap("/bin/sh", &args, env).unwrap();
    let _neighbour = tokio::process::Command::new(&wrapped.program)
        .args(&wrapped.args)
        .env_clear()
        .envs(wrapped.env)
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(processes_with(&marker) > 0);
    // Its processes are not in this jail's /proc, so neither is its /tmp (/proc/PID/root).
    // The pattern is put together in a file: no command line of this jail holds it.
    let (head, tail) = marker.split_at(8);
    let script = format!("printf '{head}%s' '{tail}' > /tmp/p; grep -lFf /tmp/p /proc/[0-9]*/cmdline | wc -l; ls /proc | grep -c '^[0-9]'; cat /tmp/mine 2>/dev/null || echo unseen");
    let ran = jailed(&Jail::default(), &script, WALL).await;
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines[0], "0", "{}", ran.stderr);
    assert!(
        lines[1].parse::<u32>().unwrap() < 10,
        "the jail sees {} processes",
        lines[1]
    );
    assert_eq!(lines[2], "unseen");
}

async fn only_relayed_ports_are_reachable() {
    let allowed = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let denied = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (port, other) = (
        allowed.local_addr().unwrap().port(),
        denied.local_addr().unwrap().port(),
    );
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = allowed.accept().await {
            use tokio::io::AsyncWriteExt;
            let _ = conn.write_all(b"hello from outside\n").await;
        }
    });
    let jail = Jail {
        ports: vec![port],
        ..Jail::default()
    };
    let probe = |target: String| {
        format!(
        "python3 -c \"import socket\ntry:\n s = socket.create_connection(({target}), timeout=3); print(s.recv(100).decode().strip() or 'connected')\nexcept OSError as e: print(type(e).__name__)\""
    )
    };
    let script = [
        probe(format!("'127.0.0.1', {port}")),
        probe(format!("'127.0.0.1', {other}")),
        probe("'1.1.1.1', 80".into()),
        probe("'10.0.0.1', 443".into()),
    ]
    .join("; ");
    let ran = jailed(&jail, &script, WALL).await;
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "hello from outside",
            "ConnectionRefusedError",
            "OSError",
            "OSError"
        ],
        "{}",
        ran.stderr
    );
}

async fn credentials_stay_outside() {
    let ran = jailed(
        &Jail::default(),
        "env | grep -c MOULT_TEST_SECRET; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n' | grep -c MOULT_TEST_SECRET",
        WALL,
    )
    .await;
    assert_eq!(
        ran.stdout.lines().collect::<Vec<_>>(),
        ["0", "0"],
        "{}",
        ran.stderr
    );
}

/// `moult.sandbox.run` of the Python SDK, with this binary as its `moult`: the checks of
/// `sandbox_run.py` (code runs and is contained; jails nest).
async fn python_sandbox_run_is_contained() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let python = std::env::var("MOULT_PYTHON").unwrap_or_else(|_| "python3".into());
    let out = tokio::process::Command::new(python)
        .arg(here.join("tests/sandbox_run.py"))
        .env("MOULT_BIN", std::env::current_exe().unwrap())
        .env("PYTHONPATH", here.join("../runtime/python"))
        .output()
        .await
        .expect("python runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    print!("{stdout}");
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count(),
        10,
        "{stdout}"
    );
}

/// One test: a function that makes its future.
type Test = fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = ()>>>;

fn main() {
    moult_jail::run_if_asked();
    // A credential of this process, which no jail may see.
    std::env::set_var("MOULT_TEST_SECRET", "s3cret");
    std::env::set_var("LD_LIBRARY_PATH", "/nonexistent/lib");
    // This binary makes the jails, as built now: never a `moult-jail` of another build.
    std::env::set_var(moult_jail::MAKER_ENV, std::env::current_exe().unwrap());
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let tests: [(&str, Test); 12] = [
        ("runs_and_reports_its_exit", || {
            Box::pin(runs_and_reports_its_exit())
        }),
        ("a_setsid_daemon_dies_with_its_episode", || {
            Box::pin(a_setsid_daemon_dies_with_its_episode())
        }),
        (
            "a_fork_bomb_meets_the_process_limit_and_dies_with_its_episode",
            || Box::pin(a_fork_bomb_meets_the_process_limit_and_dies_with_its_episode()),
        ),
        ("a_memory_hog_is_refused_and_named", || {
            Box::pin(a_memory_hog_is_refused_and_named())
        }),
        (
            "processes_that_together_hog_memory_meet_the_jails_memory_limit",
            || Box::pin(processes_that_together_hog_memory_meet_the_jails_memory_limit()),
        ),
        ("an_infinite_loop_meets_the_cpu_limit_and_is_named", || {
            Box::pin(an_infinite_loop_meets_the_cpu_limit_and_is_named())
        }),
        ("a_disk_filler_meets_the_scratch_and_file_limits", || {
            Box::pin(a_disk_filler_meets_the_scratch_and_file_limits())
        }),
        ("kept_code_is_read_only_and_scratch_is_private", || {
            Box::pin(kept_code_is_read_only_and_scratch_is_private())
        }),
        ("another_episode_is_out_of_sight", || {
            Box::pin(another_episode_is_out_of_sight())
        }),
        ("only_relayed_ports_are_reachable", || {
            Box::pin(only_relayed_ports_are_reachable())
        }),
        ("credentials_stay_outside", || {
            Box::pin(credentials_stay_outside())
        }),
        ("python_sandbox_run_is_contained", || {
            Box::pin(python_sandbox_run_is_contained())
        }),
    ];
    let mut failed = Vec::new();
    for (name, test) in tests {
        if !filter.is_empty() && !filter.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let started = Instant::now();
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| runtime.block_on(test())));
        let verdict = if outcome.is_ok() {
            "ok"
        } else {
            failed.push(name);
            "FAILED"
        };
        println!(
            "test {name} ... {verdict} ({:.1}s)",
            started.elapsed().as_secs_f64()
        );
    }
    if !failed.is_empty() {
        println!("failed: {failed:?}");
        std::process::exit(1);
    }
}
