"""An Env that does, in each episode, one thing untrusted agent code might (the task's `kind`),
after looking for what earlier episodes left behind. Its reward is 1 when it found nothing of
them, 0 when it did (`info["traces"]` says what), so a run whose every scored step has reward 1
shows that no episode saw another's doings and none got out of its jail (a write that landed, a
connection made, a credential read, memory past the limit also give 0). Used by the cluster test of hostile agent code
(runtime/tests/cluster_run.rs), where each episode runs in its own jail in an agent pod.

Kinds: daemon (a `setsid` process meant to outlive the episode), forkbomb, memory, loop (CPU until
killed), disk, tamper (writes to moult's package, to this file and to /tmp), probe (connections
to the run's ports on every pod address nearby and to an outside address), secrets (credentials
from the environment and /proc)."""

import glob
import os
import socket
import subprocess
import sys

import moult

MARK = "hostile-episode-was-here"
DAEMON = "hostile-daemon"


def traces():
    """What an earlier episode could have left where this one can see it."""
    found = []
    if glob.glob(f"/tmp/{MARK}*"):
        found.append("a marker file in /tmp")
    for cmdline in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(cmdline, "rb") as f:
                if DAEMON.encode() in f.read():
                    found.append(f"a daemon ({cmdline})")
        except OSError:
            pass
    for path in (moult.__file__, __file__):
        with open(path) as f:
            if f"\n# {MARK}\n" in f.read():
                found.append(f"tampered {path}")
    return found


def try_write(path):
    try:
        with open(path, "a") as f:
            f.write(f"\n# {MARK}\n")
        return "written"
    except OSError as e:
        return type(e).__name__


def do(kind):
    """Does the task's hostile thing; returns what happened (what the test reads)."""
    if kind == "daemon":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", DAEMON], start_new_session=True)
        return {"daemon": "started"}
    if kind == "forkbomb":
        children = 0
        try:
            for _ in range(100_000):
                if os.fork() == 0:
                    import time
                    time.sleep(600)
                    os._exit(0)
                children += 1
        except OSError as e:
            return {"forked": children, "stopped_by": type(e).__name__}
        return {"forked": children}
    if kind == "memory":
        try:
            hog = bytearray(8 << 30)
            return {"allocated": len(hog)}
        except MemoryError:
            return {"allocated": 0, "stopped_by": "MemoryError"}
    if kind == "loop":
        while True:
            pass
    if kind == "disk":
        written = 0
        try:
            with open(f"/tmp/{MARK}-fill", "wb") as f:
                while written < 4 << 30:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
                    written += 1 << 20
        except OSError as e:
            return {"written": written, "stopped_by": type(e).__name__}
        return {"written": written}
    if kind == "tamper":
        with open(f"/tmp/{MARK}", "w") as f:
            f.write("left for the next episode")
        return {"moult": try_write(moult.__file__), "self": try_write(__file__)}
    if kind == "probe":
        reached = []
        targets = [("1.1.1.1", 443), ("169.254.169.254", 80)]
        targets += [(f"10.244.0.{i}", port) for i in range(1, 24) for port in (7070, 8000, 8080, 9090, 29500, 29600)]
        for host, port in targets:
            try:
                socket.create_connection((host, port), timeout=0.2).close()
                reached.append(f"{host}:{port}")
            except OSError:
                pass
        return {"reached": reached}
    if kind == "secrets":
        found = [k for k in os.environ if "TOKEN" in k or k == "KUBECONFIG"]
        for environ in glob.glob("/proc/[0-9]*/environ"):
            try:
                with open(environ, "rb") as f:
                    if b"_TOKEN=" in f.read():
                        found.append(environ)
            except OSError:
                pass
        token = "/var/run/secrets/kubernetes.io/serviceaccount/token"
        if os.path.exists(token):
            found.append(token)
        return {"secrets": found}
    raise ValueError(f"unknown kind {kind!r}")


def breached(did):
    """What of the hostile thing got out of the episode's jail."""
    out = [f"wrote {what}" for what in ("moult", "self") if did.get(what) == "written"]
    out += [f"reached {where}" for where in did.get("reached", [])]
    out += [f"read {where}" for where in did.get("secrets", [])]
    if did.get("allocated"):
        out.append(f"allocated {did['allocated']} bytes")
    return out


class AgentRunner(moult.Env):
    def reset(self, task):
        self.seen = traces()
        self.did = do(task["kind"])
        return "Count on from 3: 3"

    def step(self, action):
        bad = self.seen + breached(self.did)
        info = {"traces": self.seen, "did": self.did, "bad": bad}
        return moult.Step(observation="", reward=0.0 if bad else 1.0, terminated=True, info=info)


if __name__ == "__main__":
    from moult.runner import serve_env

    serve_env(AgentRunner())
