"""moult.sandbox.run against the real jail (run by jail/tests/hostile.rs, whose binary is the
`moult` that MOULT_BIN names): model-written code runs, returns what it printed and wrote, and is
contained: out of time, at its limits, off the network, away from credentials and the host's
files, and with nothing left behind."""

import os
import socket
import sys
import threading
import time

import moult

sandbox = moult.sandbox
checks = []


def check(fn):
    checks.append(fn)
    return fn


def processes_with(marker):
    found = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                found += marker.encode() in f.read()
        except OSError:
            pass
    return found


@check
def code_runs_and_prints():
    r = sandbox.run("print(6 * 7)")
    assert r.ok and r.stdout == "42\n" and r.exit_code == 0, r


@check
def files_go_in_and_written_ones_come_back():
    code = "open('out/up.txt', 'w').write(open('data.txt').read().upper())"
    r = sandbox.run(code, files={"data.txt": "abc", "out/keep": b""})
    assert r.ok, r
    assert r.files == {"out/up.txt": b"ABC"}, r.files


@check
def any_program_with_stdin_and_its_exit_status():
    r = sandbox.run(argv=["sh", "-c", 'read x; echo "got $x in $HOME"; exit 3'], stdin="hi\n")
    assert r.exit_code == 3 and not r.ok, r
    assert r.stdout.startswith("got hi in /"), r


@check
def out_of_time_kills_the_code_and_what_it_started():
    marker = f"moult-sandbox-daemon-{os.getpid()}"
    code = (
        "import subprocess, sys, time\n"
        "sleep = 'import time; time.sleep(600)'\n"
        f"subprocess.Popen([sys.executable, '-c', sleep, '{marker}'], start_new_session=True)\n"
        "time.sleep(0.5)\n"
        "while True: pass\n"
    )
    r = sandbox.run(code, timeout=2)
    assert r.timed_out and r.exit_code is None and not r.ok, r
    # The sandbox's PID namespace is torn down as it ends: give a loaded machine a moment to
    # reap what the kernel killed, then nothing of it may be left.
    deadline = time.monotonic() + 10
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(marker) == 0, "a daemon outlived its sandbox"


@check
def the_cpu_limit_ends_a_loop_and_is_named():
    r = sandbox.run("while True: pass", timeout=30, limits={"cpuSeconds": 1})
    assert not r.timed_out and r.limit == "limits.cpuSeconds = 1", r


@check
def the_file_size_limit_is_named():
    r = sandbox.run("open('big', 'wb').write(b'x' * (8 << 20))", limits={"fileSize": "1Mi"})
    assert r.limit == "limits.fileSize = 1Mi", r


@check
def no_network_not_even_this_machines_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    threading.Thread(target=server.accept, daemon=True).start()
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=2); print('reached')\n"
        "except OSError as e:\n"
        "    print('refused')\n"
    )
    r = sandbox.run(code)
    assert r.stdout.strip() == "refused", r


@check
def the_host_is_read_only_and_tmp_is_private():
    here = os.path.dirname(os.path.abspath(__file__))
    code = (
        "import os\n"
        "open('/tmp/left-behind', 'w').write('x')\n"
        "try:\n"
        f"    open({os.path.join(here, 'written-by-sandbox')!r}, 'w'); print('wrote')\n"
        "except OSError as e:\n"
        "    print(e.strerror)\n"
        "print(os.environ.get('MOULT_TEST_SECRET'))\n"
    )
    r = sandbox.run(code)
    assert r.stdout.split("\n")[:2] == ["Read-only file system", "None"], r
    assert not os.path.exists("/tmp/left-behind")
    assert not os.path.exists(os.path.join(here, "written-by-sandbox"))


@check
def sandboxes_nest():
    package = os.path.dirname(os.path.dirname(os.path.abspath(moult.__file__)))
    code = "import moult; print(moult.sandbox.run('print(1 + 1)').stdout.strip())"
    r = sandbox.run(code, env={"PYTHONPATH": package}, timeout=60)
    assert r.ok and r.stdout.strip() == "2", r


@check
def bad_arguments_are_refused_naming_them():
    for kwargs, words in [
        (dict(code="1", argv=["true"]), "not both"),
        (dict(code="1", limits={"bogus": 1}), "unknown limits ['bogus']"),
        (dict(code="1", limits={"memory": "lots"}), "limits.memory must be a size"),
        (dict(code="1", files={"../x": ""}), "'../x' must be a relative path"),
        (dict(code="1", timeout=0), "timeout must be"),
    ]:
        try:
            sandbox.run(**kwargs)
        except ValueError as e:
            assert words in str(e), (words, e)
        else:
            raise AssertionError(f"{kwargs} was accepted")


failed = 0
for fn in checks:
    try:
        fn()
        print(f"ok {fn.__name__}")
    except Exception as e:  # noqa: BLE001 (every failure is reported)
        failed += 1
        print(f"FAILED {fn.__name__}: {e!r}")
sys.exit(1 if failed else 0)
