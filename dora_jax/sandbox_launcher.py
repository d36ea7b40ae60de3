"""The child side of :mod:`dora_jax.sandbox`: run as ``python -I -S sandbox_launcher.py CONFIG_JSON``.

It runs in a session of its own, in the caller's user (root, where the sandbox switches users), and supervises one
program: it takes a network namespace, forks the program's process (resource limits, a user of its own, no new
privileges, then ``exec`` of the interpreter on :data:`STUB`), waits up to the time limit, kills every process the
program left or started and reaps them, and writes one JSON line to the status descriptor. As a child subreaper
it inherits every orphan below it, so nothing the program starts (``setsid`` and double forks included) leaves its
process tree. Standard library only, imported by nothing: its start-up is part of every run.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

# What the program's interpreter runs: ``main.py`` under ``exec``, then one line in ``.outcome`` from the first
# process. Success is written with the token from ``.token`` (read and removed before the program starts), so a
# program that ends its process early (``os._exit(0)``) or writes the file itself does not pass; SystemExit counts as
# an error for the same reason.
STUB = r"""
def _stub():
    import os, sys, traceback
    write, exit_, me = os.write, os._exit, os.getpid()
    fd = os.open(".token", os.O_RDONLY)
    token = os.read(fd, 64)
    os.close(fd)
    os.unlink(".token")
    out = os.open(".outcome", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    path = os.path.abspath("main.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    sys.argv = [path]
    scope = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    try:
        exec(compile(source, path, "exec"), scope)
    except BaseException as e:
        try:
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # without this stub's frame
            what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        except BaseException:
            what = type(e).__name__
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        if os.getpid() == me:  # a forked child that got here has no say
            write(out, b"error " + what[:300].encode("utf-8", "replace"))
        exit_(1)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    if os.getpid() == me:
        write(out, b"ok " + token)
    exit_(0)
_stub()
"""


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _processes():
    """``{pid: (ppid, state)}`` of every process."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
        out[int(name)] = (int(fields[1]), fields[0].decode())
    return out


def _descendants(root):
    """Live (not zombie) processes below ``root``."""
    procs = _processes()
    children = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, ()))
        if procs[pid][1] not in "ZX":
            found.append(pid)
    return found


def _reap(main_pid):
    """Reaps every exited child; returns the main child's wait status when it was among them."""
    status = None
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == main_pid:
            status = st


def _kill_all(deadline_s=5.0):
    """Kills every process below this one (new ones a fork bomb makes meanwhile included) and reaps them."""
    me, end = os.getpid(), time.monotonic() + deadline_s
    while time.monotonic() < end:
        alive = _descendants(me)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(None)
        if not alive:
            break
    while time.monotonic() < end:  # the last ones killed: wait until they are zombies, then reap them
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.002)
        except ChildProcessError:
            return


def _limit(which, value, extra_hard=0):
    """Soft limit ``value``, hard ``value + extra_hard``, neither above the hard limit already in place."""
    hard = resource.getrlimit(which)[1]
    cap = (lambda v: v) if hard == resource.RLIM_INFINITY else (lambda v: min(v, hard))
    resource.setrlimit(which, (cap(value), cap(value + extra_hard)))


def _child(cfg, err_w, launcher, got):
    """The program's process: limits, user, then exec. Never returns."""
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        for s in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores these; an exec'd program gets the defaults
            signal.signal(s, signal.SIG_DFL)
        lim = cfg["limits"]
        try:
            _limit(resource.RLIMIT_CPU, lim["cpu_s"], 1)  # SIGXCPU at the soft limit, SIGKILL a second later
            _limit(resource.RLIMIT_AS, lim["as_bytes"])
            _limit(resource.RLIMIT_FSIZE, lim["fsize_bytes"])
            _limit(resource.RLIMIT_NOFILE, lim["nofile"])
            _limit(resource.RLIMIT_CORE, 0)
            nproc = lim["nproc"]
            if cfg["uid"] is None:  # the caller's own user: its other processes count against the limit too
                uid = os.getuid()
                nproc += sum(1 for p in os.listdir("/proc") if p.isdigit() and _owner(p) == uid)
            _limit(resource.RLIMIT_NPROC, nproc)
            got["rlimits"] = True
        except (OSError, ValueError) as e:
            if cfg["strict"]:
                raise RuntimeError(f"setting resource limits: {e}") from None
        libc = _libc()
        if cfg["uid"] is not None:
            try:
                os.setgroups([])
                os.setgid(cfg["uid"])
                os.setuid(cfg["uid"])
                got["unprivileged_user"] = True
            except OSError as e:
                if cfg["strict"]:
                    raise RuntimeError(f"switching to uid {cfg['uid']}: {e}") from None
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:  # setuid binaries would undo the switch above
            raise RuntimeError(f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(ctypes.get_errno())}")
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
        if os.getppid() != launcher:
            os._exit(1)
        os.write(err_w, ("got " + json.dumps(got) + "\n").encode())
        python = cfg["python"]
        os.execve(python, [python, "-I", "-c", STUB], dict(os.environ))
    except BaseException as e:  # noqa: BLE001 - anything before exec is the sandbox's failure, reported as such
        try:
            os.write(err_w, f"error {e}\n".encode("utf-8", "replace"))
        finally:
            os._exit(127)


def _owner(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def main(argv):
    cfg = json.loads(argv[1])
    status_fd = cfg["status_fd"]
    for fd in (status_fd, cfg.get("lock_fd")):
        if fd is not None:
            os.set_inheritable(fd, False)
    report = {"protections": {"own_session": os.getsid(0) == os.getpid(), "unprivileged_user": False,
                              "rlimits": False, "network_namespace": False}}
    try:
        report.update(_run(cfg, report["protections"]))
    except Exception as e:  # noqa: BLE001 - the sandbox itself failed: the caller raises this
        report["error"] = f"{type(e).__name__}: {e}"
    finally:
        _kill_all()
    try:
        os.write(status_fd, json.dumps(report).encode() + b"\n")
    except OSError:
        pass  # the caller is gone; nothing is left running


def _run(cfg, got):
    libc = _libc()
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise RuntimeError(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
    if cfg["netns"]:
        # As root a network namespace needs nothing else; otherwise it takes a user namespace (``unshare -rn``).
        flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
        if libc.unshare(flags) == 0:
            got["network_namespace"] = True
        elif cfg["strict"]:
            raise RuntimeError(f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}")
    err_r, err_w = os.pipe()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    start = time.monotonic()
    launcher = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(err_r)
        _child(cfg, err_w, launcher, dict(got))
    os.close(err_w)
    said = b""
    while chunk := os.read(err_r, 4096):  # ends at the exec (the pipe is close-on-exec) or the child's exit
        said += chunk
    os.close(err_r)
    for line in said.decode("utf-8", "replace").splitlines():
        if line.startswith("error "):
            raise RuntimeError(line[len("error "):])
        if line.startswith("got "):
            got.update(json.loads(line[len("got "):]))
    deadline = start + cfg["timeout_s"]
    while (status := _reap(pid)) is None:
        left = deadline - time.monotonic()
        if left <= 0:
            return {"timeout": True, "seconds": time.monotonic() - start}
        signal.sigtimedwait({signal.SIGCHLD}, left)
    out = {"seconds": time.monotonic() - start}
    if os.WIFSIGNALED(status):
        out["signal"] = os.WTERMSIG(status)
    else:
        out["exit"] = os.WEXITSTATUS(status)
    return out


if __name__ == "__main__":
    main(sys.argv)
