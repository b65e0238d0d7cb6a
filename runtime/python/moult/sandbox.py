"""Run code a model wrote, in a fresh sandbox of its own (docs/agents.md, "Running model-written
code").

Envs and ChatAgents call it to execute what the model writes, for example as a tool::

    import moult

    result = moult.sandbox.run("print(sum(range(10)))", timeout=5)
    result.stdout        # '45\\n'
    result.ok            # exited with status 0 within its time

On a cluster run with `spec.agent.sandbox`, calls go to the episode's own sandbox pod instead
(`MOULT_SANDBOX_URL`, which moult sets): the task's image, a jail per call there too, and one
working folder that the episode's calls share (docs/security.md, "Sandbox pods").

Elsewhere, each call gets its own jail, made by moult's jail maker (`MOULT_BIN`, which moult sets for every
agent program, else `moult-jail` or `moult` on the `PATH`): new PID, mount, network and user namespaces, the
whole filesystem read-only but for its own working folder (which starts with `files` in it), a
fresh tmpfs on /tmp, no network at all (not even the episode's loopback server), the resource
`limits` named as `agent.limits` names them, and `timeout` seconds of wall clock. Everything the
code started dies when it ends. The call returns what it printed, how it ended, and the files it
wrote or changed in its working folder.
"""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

__all__ = ["Result", "run", "DEFAULT_LIMITS"]

# Tighter than an episode's own (agent.limits): a snippet, not an agent.
DEFAULT_LIMITS = {
    "cpuSeconds": 10,
    "memory": "2Gi",
    "processes": 64,
    "fileSize": "64Mi",
    "scratch": "64Mi",
    "openFiles": 256,
}
# `limits` keys as the jail's fields, and whether each is a size.
_FIELDS = {
    "cpuSeconds": ("cpuSeconds", False),
    "memory": ("memoryBytes", True),
    "processes": ("processes", False),
    "fileSize": ("fileSizeBytes", True),
    "scratch": ("scratchBytes", True),
    "openFiles": ("openFiles", False),
}
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


@dataclasses.dataclass
class Result:
    """What a sandboxed run did."""

    stdout: str
    stderr: str
    # The exit status, or None when a signal ended it or it ran out of time.
    exit_code: object
    # The signal that ended it, if one did.
    signal: object
    timed_out: bool
    # The limit that ended it, named as `limits` names it ("limits.cpuSeconds = 10"), if one did.
    limit: object
    # Files of the working folder that the code wrote or changed (relative path -> bytes).
    files: dict
    # Whether stdout or stderr was longer than `max_output` (the rest is cut).
    truncated: bool = False

    @property
    def ok(self):
        """Exited with status 0 within its time."""
        return self.exit_code == 0 and not self.timed_out


def _size(field, value):
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"(\d+)([kMGT]i?)?", str(value).strip())
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"limits.{field} must be a size in bytes, as a number or a quantity (512Mi, 2Gi); got {value!r}")
    return int(m.group(1)) * _UNITS[m.group(2) or ""]


def _limits(limits):
    given = dict(limits or {})
    unknown = sorted(set(given) - set(_FIELDS))
    if unknown:
        raise ValueError(f"unknown limits {unknown}: the limits are {sorted(_FIELDS)}")
    out = {}
    for name, (field, is_size) in _FIELDS.items():
        value = given.get(name, DEFAULT_LIMITS[name])
        if is_size:
            out[field] = _size(name, value)
        elif isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[field] = value
        else:
            raise ValueError(f"limits.{name} must be a whole number of 1 or more; got {value!r}")
    return out


def _binary():
    found = os.environ.get("MOULT_BIN") or shutil.which("moult-jail") or shutil.which("moult")
    if not found:
        raise RuntimeError("moult.sandbox.run needs moult-jail or moult: set MOULT_BIN to its path or put it on the PATH (moult sets MOULT_BIN for agent programs)")
    return found


def _snapshot(folder):
    seen = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            seen[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns)
    return seen


def _read(path, limit):
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", "replace"), len(data) > limit


def run(code=None, *, argv=None, files=None, stdin=None, timeout=10.0, limits=None,
        env=None, python=None, max_output=1 << 20, max_files_bytes=16 << 20):
    """Runs `code` (Python source, as `main.py` with `python`, by default this interpreter) or
    `argv` (any program and its arguments) in a fresh sandbox and returns a `Result`.

    files: {relative path: str or bytes} put in the working folder first.
    stdin: str or bytes given to the program.
    timeout: seconds of wall clock; then the sandbox and all it holds are killed.
    limits: any of cpuSeconds, memory, processes, fileSize, scratch, openFiles (DEFAULT_LIMITS).
    env: variables for the program, beyond PATH, HOME (its folder) and the locale.
    max_output: the most bytes of stdout and of stderr returned.
    max_files_bytes: the most bytes of written files returned (larger ones are left out).
    """
    if (code is None) == (argv is None):
        raise ValueError("give code (Python source) or argv (a program and its arguments), not both")
    if argv is not None and (isinstance(argv, str) or not argv):
        raise ValueError("argv must be a non-empty list: the program and its arguments")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout must be a number of seconds above 0; got {timeout!r}")
    jail_limits = _limits(limits)
    # In the episode's sandbox pod (a cluster run with spec.agent.sandbox), or here.
    remote = bool(os.environ.get("MOULT_SANDBOX_URL"))
    given = dict(files or {})
    if code is not None:
        given.setdefault("main.py", code)
        argv = [python or ("python3" if remote else sys.executable), "main.py"]
    for name in given:
        plain = os.path.normpath(name)
        if os.path.isabs(name) or plain == "." or plain.split(os.sep)[0] == "..":
            raise ValueError(f"files: {name!r} must be a relative path inside the sandbox's folder")
    program_env = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if remote:
        return _remote(argv, given, stdin, timeout, jail_limits, program_env, max_output,
                       max_files_bytes)
    moult = _binary()
    work = tempfile.mkdtemp(prefix="moult-sandbox-")
    streams = tempfile.mkdtemp(prefix="moult-sandbox-out-")
    try:
        for name, content in given.items():
            path = os.path.join(work, os.path.normpath(name))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else bytes(content))
        before = _snapshot(work)
        program_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work,
                       "LANG": "C.UTF-8", **program_env}
        request = {
            "env": sorted(program_env.items()),
            "limits": jail_limits,
            "dir": work,
            "stdout": os.path.join(streams, "stdout"),
            "stderr": os.path.join(streams, "stderr"),
            "timeout": float(timeout),
        }
        # moult itself starts with this process's environment (its libraries), the program
        # with `program_env` alone.
        moult_env = dict(os.environ, MOULT_SANDBOX_RUN=json.dumps(request))
        data = stdin.encode() if isinstance(stdin, str) else stdin
        done = subprocess.run([moult, *map(str, argv)], input=data if data is not None else b"",
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=work,
                              env=moult_env, timeout=float(timeout) + 30)
        if done.returncode != 0:
            why = done.stderr.decode("utf-8", "replace").strip()
            raise RuntimeError(f"moult could not run the sandbox (exit {done.returncode}): {why}")
        report = json.loads(done.stdout.decode().strip().splitlines()[-1])
        stdout, cut_out = _read(request["stdout"], max_output)
        stderr, cut_err = _read(request["stderr"], max_output)
        written, total = {}, 0
        for name, stamp in sorted(_snapshot(work).items()):
            path = os.path.join(work, name)
            if before.get(name) == stamp or not os.path.isfile(path) or os.path.islink(path):
                continue
            if total + stamp[0] <= max_files_bytes:
                with open(path, "rb") as f:
                    written[name] = f.read(stamp[0])
                total += stamp[0]
        exit_ = report.get("exit") or {}
        return Result(stdout=stdout, stderr=stderr, exit_code=exit_.get("code"),
                      signal=exit_.get("signal"), timed_out=report["timedOut"],
                      limit=report.get("limit"), files=written, truncated=cut_out or cut_err)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(streams, ignore_errors=True)


def _remote(argv, given, stdin, timeout, limits, program_env, max_output, max_files_bytes):
    """The call, run by the episode's sandbox pod (its answer has `Result`'s fields)."""
    import base64
    import urllib.error
    import urllib.request

    as_bytes = lambda v: v.encode() if isinstance(v, str) else bytes(v or b"")
    body = json.dumps({
        "argv": [str(a) for a in argv],
        "files": {k: base64.b64encode(as_bytes(v)).decode() for k, v in given.items()},
        "stdin": base64.b64encode(as_bytes(stdin)).decode(),
        "timeout": float(timeout),
        "limits": limits,
        "env": sorted(program_env.items()),
        "maxOutput": int(max_output),
        "maxFilesBytes": int(max_files_bytes),
    }).encode()
    request = urllib.request.Request(os.environ["MOULT_SANDBOX_URL"], data=body, method="POST", headers={
        "Authorization": "Bearer " + os.environ.get("MOULT_SANDBOX_TOKEN", ""),
        "Content-Type": "application/json",
    })
    try:
        # A pod may first have to be claimed (a cold one started): minutes, not seconds.
        with urllib.request.urlopen(request, timeout=float(timeout) + 330) as answer:
            got = json.loads(answer.read())
    except urllib.error.HTTPError as e:
        why = e.read().decode("utf-8", "replace").strip()
        raise RuntimeError(f"the episode's sandbox pod could not run the call ({e.code}): {why}") from None
    return Result(stdout=got["stdout"], stderr=got["stderr"], exit_code=got.get("exitCode"),
                  signal=got.get("signal"), timed_out=got["timedOut"], limit=got.get("limit"),
                  files={k: base64.b64decode(v) for k, v in got["files"].items()},
                  truncated=got["truncated"])
