"""Running untrusted Python programs: a child process with limits, a user of its own and no network.

:func:`run_python` runs one script (a model's program with its tests) to the end, a time limit or a broken limit,
and returns a :class:`Result`: whether it ran to its end without an uncaught exception, and why not. What the
sandbox obtains depends on the OS and on the caller's privileges; :func:`probe` finds out once and says which
:class:`Protections` hold. docs/sandbox.md describes each and what it needs. Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import math
import os
import pwd
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

__all__ = ["Limits", "Protections", "Result", "SandboxError", "probe", "run_python"]

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
# Programs run under a uid of this range, one per run at a time (a lock file each), with a group of the same
# number: its limits on processes count only that run's, and killing by uid kills only what that run started.
UID_BASE, UID_COUNT = 60000, 64
UID_LOCKS = "/tmp/dora-jax-sandbox-uids"  # fixed, not $TMPDIR: every process sharing the range must agree
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
# What a run may take beyond its time limit (two interpreters' start, the clean-up) before the caller stops waiting.
GRACE_S = 2.0


class SandboxError(RuntimeError):
    """The sandbox itself could not run a program (not the program's fault)."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one run may use. ``memory_mb`` is address space per process; ``processes`` counts threads too."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    output_bytes: int = 1 << 20  # per stream (stdout, stderr); the rest is read and dropped
    processes: int = 32
    open_files: int = 64
    file_mb: int = 64


@dataclasses.dataclass(frozen=True)
class Protections:
    """Which protections a run has. ``unprivileged_user``: a uid of its own (only when the caller is root)."""

    own_session: bool = False
    unprivileged_user: bool = False
    rlimits: bool = False
    network_namespace: bool = False

    def __str__(self) -> str:
        return ", ".join(f"{f.name} {'yes' if getattr(self, f.name) else 'NO'}" for f in dataclasses.fields(self))


@dataclasses.dataclass(frozen=True)
class Result:
    """One run: ``passed`` (ran to its end, exit 0) and ``reason`` (``"ok"``, ``"failed: AssertionError"``,
    ``"timeout after 2s"``, ``"crashed: signal SIGSEGV"``, ``"memory limit (MemoryError)"``, with ``"; output cut at
    N bytes"`` appended when a stream was cut)."""

    passed: bool
    reason: str
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0
    protections: Protections = Protections()


_PROBED: dict[str, tuple[Protections, str]] = {}


def probe(python: str = "") -> tuple[Protections, str]:
    """Runs an empty program to find which protections this machine gives, once per process and interpreter.

    Args:
      python: the interpreter programs run with; empty: this process's own, or else (when the sandbox's user cannot
        run it, e.g. it lives under a private home directory) the first ``python3`` on the sandbox's ``PATH``.

    Returns:
      ``(protections, interpreter)``: what runs get, and the interpreter's path.

    Raises:
      SandboxError: no program can be run (the message says why).
    """
    if python not in _PROBED:
        candidates = [python] if python else [sys.executable, shutil.which("python3", path=SANDBOX_PATH)]
        errors = []
        for exe in dict.fromkeys(c for c in candidates if c):
            try:
                result = run_python("pass", Limits(timeout_s=30.0), python=exe, protections=None)
            except SandboxError as e:
                errors.append(f"{exe}: {e}")
                continue
            if not result.passed:
                errors.append(f"{exe}: an empty program {result.reason}: {result.stderr[-300:]}")
                continue
            _PROBED[python] = (result.protections, exe)
            break
        else:
            raise SandboxError("the sandbox cannot run Python programs here: " + "; ".join(errors))
    return _PROBED[python]


def run_python(source: str, limits: Limits = Limits(), *, python: str,
               protections: Protections | None) -> Result:
    """Runs ``source`` as a script in the sandbox.

    Args:
      source: the script; it passes when it runs to its end without an uncaught exception (``sys.exit`` included).
      limits: time, memory, output and process limits.
      python: the interpreter (from :func:`probe`).
      protections: the protections to insist on (from :func:`probe`); a run that cannot get them raises.
        None: take what the OS gives (what :func:`probe` does).

    Raises:
      SandboxError: the sandbox failed to start or supervise the program.
    """
    strict = protections is not None
    want = protections or Protections(True, os.geteuid() == 0, True, True)
    lock = _take_uid() if want.unprivileged_user else None
    try:
        work = tempfile.mkdtemp(prefix="dora-sandbox-")
        try:
            return _run(source, limits, python, want, strict, work, lock)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        if lock is not None:
            os.close(lock[1])


def _run(source: str, limits: Limits, python: str, want: Protections, strict: bool, work: str,
         lock: tuple[int, int] | None) -> Result:
    token = secrets.token_hex(16)
    for name, text in (("main.py", source), (".token", token)):
        with open(os.path.join(work, name), "w", encoding="utf-8", errors="replace") as f:
            f.write(text)
    uid = lock[0] if lock else None
    if uid is not None:
        for p in (work, os.path.join(work, "main.py"), os.path.join(work, ".token")):
            os.chown(p, uid, uid)
        os.chmod(work, 0o700)
    status_r, status_w = os.pipe()
    cfg = {"python": python, "timeout_s": limits.timeout_s, "uid": uid, "netns": want.network_namespace,
           "strict": strict, "status_fd": status_w, "lock_fd": lock[1] if lock else None,
           # CPU time a second past the wall-clock limit: that limit comes first; this one is the backstop.
           "limits": {"cpu_s": math.ceil(limits.timeout_s) + 1, "as_bytes": limits.memory_mb << 20,
                      "fsize_bytes": limits.file_mb << 20, "nofile": limits.open_files, "nproc": limits.processes}}
    # Nothing of the caller's environment: the program sees these and nothing else. One thread per numeric
    # library, since threads count against the process limit.
    env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8", "HOME": work, "TMPDIR": work, "OMP_NUM_THREADS": "1",
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    fds = (status_w,) + ((lock[1],) if lock else ())
    try:
        proc = subprocess.Popen([sys.executable, "-I", "-S", LAUNCHER, json.dumps(cfg)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=fds, close_fds=True,
                                start_new_session=True, cwd=work, env=env)
    except OSError as e:
        os.close(status_r)
        raise SandboxError(f"cannot start the sandbox launcher: {e}") from None
    finally:
        os.close(status_w)
    try:
        (out, out_n), (err, err_n) = _read(proc, limits.output_bytes, time.monotonic() + limits.timeout_s + GRACE_S)
    finally:
        # The launcher is not reaped yet, so its process group id is still its own: this kills what is left of the
        # group only (nothing, unless the launcher died or hung), then whatever runs under the run's uid.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        if uid is not None:
            _kill_uid(uid)
        with os.fdopen(status_r, "rb") as f:
            status_line = f.read(1 << 16)
    stdout, stderr = (b.decode("utf-8", "replace") for b in (out, err))
    try:
        status = json.loads(status_line)
    except ValueError:
        raise SandboxError(f"the sandbox launcher ended without a report (exit {proc.returncode}): "
                           f"{stderr[-500:]}") from None
    if "error" in status:
        raise SandboxError(f"the sandbox could not run the program: {status['error']}")
    passed, reason = _verdict(status, limits, _outcome(work), token)
    cut = [f"{n} bytes" for n in (out_n, err_n) if n > limits.output_bytes]
    if cut:
        reason += f"; output cut at {limits.output_bytes} bytes (of {' and '.join(cut)})"
    return Result(passed, reason, stdout, stderr, status.get("seconds", 0.0), Protections(**status["protections"]))


def _verdict(status: dict, limits: Limits, outcome: str, token: str) -> tuple[bool, str]:
    if status.get("timeout"):
        return False, f"timeout after {limits.timeout_s:g}s"
    if "signal" in status:
        sig = status["signal"]
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = str(sig)
        return False, "cpu time limit (SIGXCPU)" if sig == signal.SIGXCPU else f"crashed: signal {name}"
    code = status.get("exit")
    if code == 0 and outcome == f"ok {token}":
        return True, "ok"
    if outcome.startswith("error "):
        what = outcome[len("error "):]
        return False, (f"memory limit ({what})" if what.startswith("MemoryError") else f"failed: {what}")
    if code == 0:
        return False, "failed: the process exited (code 0) before the script's end"
    return False, f"failed: exit {code}"


def _outcome(work: str) -> str:
    """The stub's one line, read without following links or blocking (the program owned the directory)."""
    try:
        fd = os.open(os.path.join(work, ".outcome"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, 512).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _read(proc: subprocess.Popen, limit: int, deadline: float) -> tuple[tuple[bytes, int], tuple[bytes, int]]:
    """Both output streams, each kept up to ``limit`` bytes and counted beyond, until both close or the deadline."""
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    seen = dict.fromkeys(kept, 0)
    with selectors.DefaultSelector() as sel:
        for f in kept:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                seen[key.fileobj] += len(chunk)
                buf = kept[key.fileobj]
                if len(buf) < limit:
                    buf += chunk[:limit - len(buf)]
    for f in kept:
        f.close()
    return tuple((bytes(kept[f]), seen[f]) for f in (proc.stdout, proc.stderr))  # type: ignore[return-value]


_FREE_UIDS: list[int] = []


def _take_uid() -> tuple[int, int]:
    """``(uid, lock fd)``: a uid of the range no other run holds and no user of this machine has."""
    if not _FREE_UIDS:
        _FREE_UIDS.extend(u for u in range(UID_BASE, UID_BASE + UID_COUNT) if not _has_user(u))
    os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
    st = os.lstat(UID_LOCKS)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SandboxError(f"{UID_LOCKS} must be a directory of this user's with mode 0700 (someone else made it?)")
    start = os.getpid() % max(len(_FREE_UIDS), 1)
    for uid in _FREE_UIDS[start:] + _FREE_UIDS[:start]:
        fd = os.open(os.path.join(UID_LOCKS, str(uid)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _kill_uid(uid)  # left by a run whose launcher was killed
        return uid, fd
    raise SandboxError(f"all {len(_FREE_UIDS)} sandbox uids ({UID_BASE}-{UID_BASE + UID_COUNT - 1}) are in use")


def _has_user(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def _kill_uid(uid: int) -> None:
    """Kills every process of ``uid`` (a few rounds: one may fork while the others die)."""
    for _ in range(5):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    os.kill(int(name), signal.SIGKILL)
                    found = True
            except (OSError, ValueError):
                pass
        if not found:
            return
        time.sleep(0.01)
