"""The code task and its sandbox: each protection against a program that breaks it, scored through the task and
through the reward pool's worker processes.

Every program that breaks a limit also defines a correct ``add``: without the protection it would pass its tests
and score 1, so each test fails when its protection is missing. Programs that could hurt this machine with the
protection gone are bounded (100 forks, 10 GB of address space never touched), and after every test whatever a
program started is killed here too (:func:`no_leftovers`), so a broken sandbox cannot leave processes behind.
"""

import copy
import json
import os
import re
import shutil
import signal
import tempfile
import time

import pytest

from dora_jax import sandbox
from dora_jax.config import ConfigError, TaskConfig, load_config
from dora_jax.rewards import RewardPool
from dora_jax.rollout.samples import Sample
from dora_jax.run.training import write_samples
from dora_jax.tasks import CodeTask, TaskDataError, load_task
from dora_jax.tasks.base import score_answer
from dora_jax.tasks.code import extract_program

LIMITS = sandbox.Limits(timeout_s=1.0, processes=16, output_bytes=64 << 10)
ADD = "def add(a, b):\n    return a + b\n"
ROWS = [{"prompt": f"Write add(a, b) ({i}).", "test": f"assert add(2, 3) == 5\nassert add({i}, 1) == {i + 1}"}
        for i in range(3)]


def _processes_of_the_sandbox():
    """Live processes a sandbox started: its launcher, its program (and forks of it), anything under its uids."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
            uid = os.stat(f"/proc/{name}").st_uid
        except OSError:
            continue
        ours = b"_stub()" in cmd or b"sandbox_launcher" in cmd
        if state != b"Z" and (ours or sandbox.UID_BASE <= uid < sandbox.UID_BASE + sandbox.UID_COUNT):
            found.append(int(name))
    return found


@pytest.fixture(autouse=True)
def no_leftovers():
    """After each test nothing a sandboxed program started is alive; whatever is (a broken sandbox) is killed."""
    yield
    left = _processes_of_the_sandbox()
    for _ in range(50):
        pids = _processes_of_the_sandbox()
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    assert not left, f"processes the sandbox left running: {left}"


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    path = tmp_path_factory.mktemp("code") / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return CodeTask(str(path), eval_size=1, limits=LIMITS)


def answer(program):
    return f"Here is my solution.\n```python\n{program}\n```\nIt adds."


def score(task, program):
    return task.score(task.eval_items()[0], answer(program))


def test_the_sandbox_gets_every_protection_as_root(task):
    if os.geteuid() != 0:
        pytest.skip("a uid of the program's own needs root")
    # A network namespace needs CAP_SYS_ADMIN, which containers often drop even for root: test_no_network checks
    # it where the machine gives it.
    p = task.protections
    assert (p.own_session, p.unprivileged_user, p.rlimits) == (True, True, True), p
    assert os.access(task.python, os.X_OK)


@pytest.mark.parametrize("program,passed,reason", [
    (ADD, True, "ok"),
    ("def add(a, b):\n    return a - b", False, "failed: AssertionError"),
    ("def add(a, b):\n    return a +", False, "failed: SyntaxError: invalid syntax (main.py, line 2)"),
    # Ending the process before the tests run is not a pass, however it exits.
    (ADD + "import sys\nsys.exit(0)", False, "failed: SystemExit: 0"),
    (ADD + "import os\nos._exit(0)", False, "failed: the process exited (code 0) before the script's end"),
    # Its own directory (also $HOME and $TMPDIR) is the program's to write.
    (ADD + "import os\nopen('scratch.txt', 'w').write('x')\nopen(os.environ['TMPDIR'] + '/b', 'w').write('y')",
     True, "ok"),
])
def test_correct_and_wrong_programs(task, program, passed, reason):
    s = score(task, program)
    assert (s.reward, s.correct, s.reason) == (float(passed), passed, reason)


def test_megabytes_of_output_are_cut_and_still_scored(task):
    for body, passed in ((ADD, True), ("def add(a, b):\n    return 0", False)):
        result = sandbox.run_python(f"print('x' * 3_000_000)\n{body}\nassert add(2, 3) == 5", LIMITS,
                                    python=task.python, protections=task.protections)
        assert result.passed is passed and len(result.stdout) == 64 << 10
        assert result.reason.endswith("; output cut at 65536 bytes (of 3000001 bytes)")
        assert result.reason.startswith("ok" if passed else "failed: AssertionError")


def test_a_fork_bomb_is_stopped_by_the_process_limit(task):
    # Every child sleeps: without the limit there would be 100 of them, not an unbounded number.
    bomb = ("import os, time\nfor _ in range(100):\n    if os.fork() == 0:\n        time.sleep(30)\n"
            "        os._exit(0)\n")
    s = score(task, bomb + ADD)
    assert s.reward == 0.0 and s.reason == "failed: BlockingIOError: [Errno 11] Resource temporarily unavailable"


def test_allocating_10_gb_hits_the_memory_limit(task):
    # bytes() of this size is calloc'ed: without the limit it takes address space, not memory.
    s = score(task, "block = bytes(10 * 2**30)\n" + ADD)
    assert (s.reward, s.reason) == (0.0, "memory limit (MemoryError)")


def test_writing_outside_its_directory_is_refused(task):
    target = tempfile.mkdtemp(prefix="dora-test-outside-")  # root's, mode 0755, in the world-writable /tmp
    os.chmod(target, 0o755)
    try:
        s = score(task, f"open({target!r} + '/escaped.txt', 'w').write('x')\n" + ADD)
        assert s.reward == 0.0 and s.reason.startswith("failed: PermissionError: [Errno 13] Permission denied")
        assert not os.path.exists(os.path.join(target, "escaped.txt"))
    finally:
        shutil.rmtree(target)


def test_no_network(task):
    if not task.protections.network_namespace:
        pytest.skip("this machine gives no network namespace (docs/sandbox.md)")
    # A UDP connect sends nothing; it fails only where there is no route, as in a fresh network namespace.
    s = score(task, "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).connect(('8.8.8.8', 53))\n" + ADD)
    assert (s.reward, s.reason) == (0.0, "failed: OSError: [Errno 101] Network is unreachable")


def test_the_environment_has_no_secrets(task, monkeypatch):
    monkeypatch.setenv("DORA_TEST_SECRET", "hunter2")
    s = score(task, "import os\nassert os.environ['DORA_TEST_SECRET'] == 'hunter2'\n" + ADD)
    assert (s.reward, s.reason) == (0.0, "failed: KeyError: 'DORA_TEST_SECRET'")


def test_a_program_past_its_time_is_killed(task):
    t0 = time.perf_counter()
    s = score(task, "import time\ntime.sleep(30)\n" + ADD)
    assert (s.reward, s.reason) == (0.0, "timeout after 1s")
    assert time.perf_counter() - t0 < LIMITS.timeout_s + 1.5


@pytest.mark.parametrize("main_waits", [True, False])
def test_nothing_a_program_started_outlives_it(task, main_waits):
    """A grandchild in a session of its own (a double fork with setsid) is killed, whether the program times out
    or ends first (it passes then: leaving a process behind is not a failure, just not allowed to last)."""
    program = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        print(os.getpid(), flush=True)\n        time.sleep(30)\n    os._exit(0)\n"
               f"os.wait()\ntime.sleep({30 if main_waits else 0.1})\n" + ADD + "assert add(2, 3) == 5\n")
    result = sandbox.run_python(program, LIMITS, python=task.python, protections=task.protections)
    assert (result.passed, result.reason) == ((False, "timeout after 1s") if main_waits else (True, "ok"))
    grandchild = int(result.stdout.split()[0])
    assert not os.path.exists(f"/proc/{grandchild}")


def test_through_the_reward_pool(task, monkeypatch):
    """As the runner scores samples: the task pickled to worker processes (whose environment has the secret),
    reasons in the results; a sandbox that cannot start its program is the reward machinery's failure, which
    filters the sample (an error), unlike anything the program does."""
    monkeypatch.setenv("DORA_TEST_SECRET", "hunter2")
    broken = copy.copy(task)
    broken.python = "/nonexistent/python3"
    item = task.eval_items()[0]
    responses = {1: answer(ADD), 2: answer("def add(a, b):\n    return a * b"),
                 3: answer("import os\nprint(os.environ['DORA_TEST_SECRET'])\n" + ADD),
                 4: answer("while True:\n    pass")}
    with RewardPool(workers=2, timeout_s=LIMITS.timeout_s + sandbox.GRACE_S + 1) as pool:
        for key, text in responses.items():
            pool.submit(key, score_answer, task, item, text)
        pool.submit(5, score_answer, broken, item, answer(ADD))
        got = {}
        t0 = time.perf_counter()
        while len(got) < 5 and time.perf_counter() - t0 < 30:
            got.update((r.key, r) for r in pool.poll(0.1))
    assert [(got[k].reward, got[k].correct, got[k].reason, got[k].error) for k in (1, 2, 3, 4)] == [
        (1.0, True, "ok", ""), (0.0, False, "failed: AssertionError", ""),
        (0.0, False, "failed: KeyError: 'DORA_TEST_SECRET'", ""), (0.0, False, "timeout after 1s", "")]
    assert got[5].error.startswith("reward function raised SandboxError: the sandbox could not run the program: ")
    assert "/nonexistent/python3" in got[5].error


def test_the_reason_is_kept_with_the_sample(tmp_path):
    sample = Sample(1, 0, 0, [1], [2], [-0.5], 0.0, "eos", text="x", reason="timeout after 1s")
    assert Sample.from_dict(sample.to_dict()) == sample
    old = {k: v for k, v in sample.to_dict().items() if k != "reason"}  # a checkpoint from before reasons
    assert Sample.from_dict(old).reason == ""
    write_samples(str(tmp_path / "samples.jsonl"), [sample], trained_at=1)
    assert json.loads((tmp_path / "samples.jsonl").read_text())["reason"] == "timeout after 1s"


def test_extracting_the_program():
    assert extract_program("```python\na = 1\n```\nthen\n```python\nb = 2\n```") == "b = 2\n"
    assert extract_program("```py\na = 1\n```\nOutput:\n```\n3\n```") == "a = 1\n"  # a python block first
    assert extract_program("```\nc = 3\n```") == "c = 3\n"
    assert extract_program("x = 1") == "x = 1"
    assert extract_program("```python\nunfinished") == "```python\nunfinished"


def test_data_formats_and_errors(tmp_path, task):
    """HumanEval (check(candidate) with entry_point), MBPP (a list of asserts with their imports) and test_
    functions, from JSONL and JSON; rows without usable tests are named with their file and line."""
    rows = [{"prompt": "def inc(x):", "entry_point": "inc",
             "test": "def check(candidate):\n    assert candidate(1) == 2\n"},
            {"text": "Sort a list.", "test_list": ["assert s([2, 1]) == [1, 2]"], "test_imports": ["import math"]},
            {"prompt": "Write neg(x).", "tests": "def test_neg():\n    assert neg(2) == -2\n"}]
    right = ["def inc(x):\n    return x + 1", "def s(x):\n    return sorted(x) if math.pi else x",
             "def neg(x):\n    return -x"]
    wrong = ["def inc(x):\n    return x", "def s(x):\n    return x", "def neg(x):\n    return x"]
    (tmp_path / "t.json").write_text(json.dumps(rows))
    coded = CodeTask(str(tmp_path / "t.json"), eval_size=0, limits=LIMITS)
    items = {it.prompt: it for it in (coded.train_item(i) for i in range(3))}
    for row, good, bad in zip(rows, right, wrong):
        item = items[row.get("prompt") or row.get("text")]
        assert coded.score(item, answer(good)).correct
        assert coded.score(item, answer(bad)).reason == "failed: AssertionError"
    bad = tmp_path / "bad.jsonl"
    for row, message in [({"prompt": "p"}, r"bad.jsonl:2: needs tests in field 'test / tests / test_list'"),
                         ({"prompt": "p", "test": ""}, r"bad.jsonl:2: needs tests in field 'test'"),
                         ({"prompt": "p", "test": "assert (("}, r"bad.jsonl:2: the tests in field 'test' are not "
                                                                 r"valid Python"),
                         ({"test": "assert 1"}, r"bad.jsonl:2: needs a non-empty prompt")]:
        bad.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(TaskDataError, match=message):
            CodeTask(str(bad), eval_size=0)
    with pytest.raises(TaskDataError, match=r"bad.jsonl:1: needs tests in field 'checks'"):
        CodeTask(str(bad), eval_size=0, tests_field="checks")


def test_config_and_load_task(tmp_path, task):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    loaded = load_task(TaskConfig(name="code", path=str(path), eval_size=1, code_timeout_s=1.0, code_memory_mb=256,
                                  code_output_kb=4))
    assert isinstance(loaded, CodeTask) and loaded.limits == sandbox.Limits(timeout_s=1.0, memory_mb=256,
                                                                           output_bytes=4096)
    for override, message in [
            ("task.code_timeout_s=0", "'task.code_timeout_s' = 0.0: must be > 0 seconds"),
            ("task.code_memory_mb=32", "'task.code_memory_mb' = 32: must be >= 64 MiB"),
            ("task.code_output_kb=0", "'task.code_output_kb' = 0: must be >= 1 KiB"),
            ("task.code_python=python3", "'task.code_python' = 'python3': must be an absolute path"),
            ("task.code_timeout_s=8", "'task.reward_timeout_s' = 10.0: must be at least task.code_timeout_s + 3 s = "
                                      "11"),
            ("task.path=''", "'task.path' = '': task 'code' reads its data from here")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, ["task.name=code", f"task.path={path}", override])
