"""Tasks, reward checking, the reward pool and run plots: plain Python, hand-derived cases."""

import json
import math
import os
import pickle
import signal
import time

import pytest

from dora_jax.config import ConfigError, TaskConfig
from dora_jax.metrics import MetricsError, MetricsWriter, plot_run, read_metrics
from dora_jax.rewards import RewardPool
from dora_jax.tasks import ArithmeticTask, LongTailTask, last_number, load_task
from dora_jax.tasks.gsm8k import JsonlTask, TaskDataError
from dora_jax.tokenizer import ByteTokenizer


def test_arithmetic_items_answers_and_scores():
    task = ArithmeticTask(seed=3, eval_size=60)
    for i in range(300):
        item = task.train_item(i)
        expr = item.prompt.removeprefix("What is ").removesuffix("? Answer with the number only.")
        assert int(item.answer) == eval(expr)  # noqa: S307 - the test's own independent evaluation
        assert item.level == task.levels[i % len(task.levels)]
    assert task.train_item(17) == ArithmeticTask(seed=3, eval_size=60).train_item(17)  # pure in (seed, index)
    assert task.train_item(17) != ArithmeticTask(seed=4, eval_size=60).train_item(17)
    held_out = {it.prompt for it in task.eval_items()}
    assert len(task.eval_items()) == 60 and not held_out & {task.train_item(i).prompt for i in range(2000)}
    item = task.train_item(0)
    ans = item.answer
    assert task.score(item, ans).reward == 1.0 and task.score(item, f" {ans}.").correct
    assert task.score(item, f"3 + 8 = {ans}").correct  # the last number counts
    assert not task.score(item, f"{ans} is wrong, it is {int(ans) + 1}").correct
    assert task.score(item, "no idea").reward == 0.0


def test_last_number_extraction():
    assert last_number("so 1,234 apples") == "1234"
    assert last_number("it is -7.") == "-7"
    assert last_number("x = 3.25 then 4") == "4"
    assert last_number("none") is None


def test_gsm8k_jsonl_loader_and_errors(tmp_path):
    path = tmp_path / "train.jsonl"
    rows = [{"question": f"Q{i}: what is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(10)]
    rows.append({"prompt": "How many?", "answer": "1,000"})
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = JsonlTask(str(path), eval_size=3, seed=0)
    items = task.eval_items() + [task.train_item(i) for i in range(8)]
    assert sorted(it.prompt for it in items) == sorted(r.get("question", r.get("prompt")) for r in rows)
    q = next(it for it in items if it.prompt == "How many?")
    assert q.answer == "1000" and task.score(q, "That makes 1,000.").correct
    q5 = next(it for it in items if it.prompt.startswith("Q5:"))
    assert q5.answer == "6" and task.score(q5, "6").reward == 1.0 and task.score(q5, "5 + 1 = 7").reward == 0.0

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n{not json\n")
    with pytest.raises(TaskDataError, match=r"bad.jsonl:2: not valid JSON"):
        JsonlTask(str(bad), eval_size=0)
    bad.write_text(json.dumps({"question": "q", "answer": "no number here"}) + "\n")
    with pytest.raises(TaskDataError, match=r"bad.jsonl:1: the answer .* has no number"):
        JsonlTask(str(bad), eval_size=0)
    bad.write_text(json.dumps({"answer": "4"}) + "\n")
    with pytest.raises(TaskDataError, match=r"bad.jsonl:1: needs a non-empty prompt in field 'question / prompt'"):
        JsonlTask(str(bad), eval_size=0)
    bad.write_bytes(json.dumps(rows[0]).encode() + b"\n" + '{"question": "caf\u00e9?", "answer": "1"}'.encode("latin-1")
                    + b"\n")
    with pytest.raises(TaskDataError, match=r"bad.jsonl: line 2 is not UTF-8 text"):
        JsonlTask(str(bad), eval_size=0)
    with pytest.raises(TaskDataError, match="11 usable lines; need more than task.eval_size=20"):
        JsonlTask(str(path), eval_size=20)
    with pytest.raises(TaskDataError, match="does not exist"):
        load_task(TaskConfig(name="gsm8k", path=str(tmp_path / "missing.jsonl")))
    with pytest.raises(TaskDataError, match="task.path: this task needs data"):
        load_task(TaskConfig(name="gsm8k"))


def make_task(cfg):
    return ArithmeticTask(seed=cfg.seed, eval_size=2, levels=("add1",))


def constant_reward(prompt, response, answer):
    return 0.25


def not_a_task(cfg):
    return 0.5


def test_custom_task_and_reward_by_import_path():
    task = load_task(TaskConfig(name="test_tasks:make_task", reward="test_tasks:constant_reward"))
    item = task.train_item(0)
    assert item.level == "add1" and task.score(item, "anything").reward == 0.25
    with pytest.raises(ConfigError, match="task.name: 'test_tasks:not_a_task' returned float"):
        load_task(TaskConfig(name="test_tasks:not_a_task"))
    with pytest.raises(ConfigError, match="is not an import path"):
        load_task(TaskConfig(reward="test_tasks:"))


def test_user_code_failing_on_import_or_call_is_named(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "user_raises_on_import.py").write_text("x = 1\nraise RuntimeError('no API key')\n")
    (tmp_path / "user_syntax_error.py").write_text("def reward(:\n")
    (tmp_path / "user_factory.py").write_text("def make(cfg):\n    return {}['missing']\n")
    with pytest.raises(ConfigError, match=r"task.reward: importing module 'user_raises_on_import' failed: "
                                          r"RuntimeError: no API key \(at .*user_raises_on_import.py:2\)"):
        load_task(TaskConfig(reward="user_raises_on_import:reward"))
    with pytest.raises(ConfigError, match=r"task.name: importing module 'user_syntax_error' failed: SyntaxError: "
                                          r".*\(at .*user_syntax_error.py:1\)"):
        load_task(TaskConfig(name="user_syntax_error:make"))
    with pytest.raises(ConfigError, match=r"task.name: 'user_factory:make' raised KeyError: 'missing' "
                                          r"\(at .*user_factory.py:2\)"):
        load_task(TaskConfig(name="user_factory:make"))


def test_longtail_lengths_are_long_tailed():
    task = LongTailTask(seed=0, max_len=128)
    budgets = sorted(task.train_item(i).budget(m, 128) for i in range(1000) for m in range(4))
    p50, p99 = budgets[len(budgets) // 2], budgets[int(0.99 * len(budgets))]
    assert p99 / p50 >= 8 and 1 <= budgets[0] and budgets[-1] <= 128
    # Each member draws its own budget, so a batch of 16 samples (4 groups of 4) almost always meets the tail,
    # as the docstring promises; one budget per group would meet it in only 1 - 0.85^4 = 48% of batches.
    long = [any(task.train_item(4 * b + g).budget(m, 128) >= 64 for g in range(4) for m in range(4))
            for b in range(250)]
    assert sum(long) / len(long) >= 0.85
    assert task.train_item(3).budget(1, 16) <= 16 and task.train_item(3).budget(1, 10**6) >= 1
    item = task.train_item(0)
    assert task.score(item, "12ab").reward == 0.5 and task.score(item, "").reward == 0.0


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert text == "Q: héllo\nA: " and tok.decode(tok.encode(text)) == text and tok.eos_ids == ()


def _slow(x):
    time.sleep(x)
    return x, True


def _bad(kind):
    if kind == "raise":
        raise KeyError("missing")
    if kind == "huge":  # finite in Python, infinite in the trainer's float32
        return 1e300, True
    return float("nan"), False


def _pid(_):
    return float(os.getpid()), True


def _forever():
    while True:
        time.sleep(3600)


def _crash(how):
    if how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def _gone(pids, within_s=10.0):
    """Whether every process in ``pids`` has ended (and been reaped) within ``within_s``."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < within_s:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def _collect(pool, n, limit_s=30.0):
    got, t0 = {}, time.perf_counter()
    while len(got) < n and time.perf_counter() - t0 < limit_s:
        for r in pool.poll(wait_s=0.1):
            assert r.key not in got
            got[r.key] = r
    return got


def test_reward_pool_results_errors_and_timeouts():
    pool = RewardPool(workers=2, timeout_s=0.5)
    pool.submit(1, _slow, 0.0)
    pool.submit(2, _bad, "raise")
    pool.submit(3, _bad, "nan")
    pool.submit(4, _slow, 5.0)  # runs past the timeout
    pool.submit(5, _slow, 0.01)  # must still be served: the killed worker is replaced
    pool.submit(6, _bad, "huge")
    got = _collect(pool, 6)
    assert got[1].reward == 0.0 and got[1].correct and not got[1].error
    assert got[2].error == "reward function raised KeyError: 'missing'"
    assert "returned a reward nan that is not a finite float32 number" in got[3].error
    assert "returned a reward 1e+300 that is not a finite float32 number" in got[6].error
    assert got[4].error == "reward function timed out after 0.5s" and 0.5 <= got[4].seconds < 2
    assert got[5].reward == 0.01 and not got[5].error
    assert pool.outstanding == 0
    pool.close()
    with pytest.raises(ValueError, match="workers >= 1"):
        RewardPool(workers=0)


def test_a_hung_reward_costs_one_timeout_and_leaves_nothing_behind():
    import multiprocessing
    import threading

    before = set(threading.enumerate())
    pool = RewardPool(workers=1, timeout_s=0.5)
    pool.submit(1, _pid, 0)
    first = _collect(pool, 1)[1]
    t0 = time.perf_counter()
    pool.submit(2, _forever)
    pool.submit(3, _pid, 0)  # waits behind the hung call, then runs on the replacement worker
    got = _collect(pool, 2)
    assert got[2].error == "reward function timed out after 0.5s"
    assert time.perf_counter() - t0 < 3  # one timeout, not one per queued call
    hung_pid, new_pid = int(first.reward), int(got[3].reward)
    assert not got[3].error and new_pid != hung_pid
    assert _gone([hung_pid])  # the hung worker was killed, not abandoned
    pool.close()
    assert _gone([new_pid])
    assert set(threading.enumerate()) == before and not multiprocessing.active_children()


@pytest.mark.parametrize("how,reason", [("exit", "exit code 3"), ("kill", "killed by signal SIGKILL")])
def test_a_crashed_reward_worker_is_reported_and_replaced(how, reason):
    with RewardPool(workers=1, timeout_s=5.0) as pool:
        pool.submit(1, _crash, how)
        pool.submit(2, _slow, 0.0)
        got = _collect(pool, 2)
    assert got[1].error == f"the reward worker process died while scoring ({reason})"
    assert not got[2].error and got[2].correct


def _env(name):
    return float(len(os.environ.get(name, ""))), name in os.environ


def test_reward_workers_see_the_environment_set_after_an_earlier_pool(monkeypatch):
    """A worker sees the parent's environment as of its start, whatever process it was forked from (a forkserver
    keeps the environment it started with: a variable set after an earlier pool reaches no worker by itself)."""
    name = "DORA_TEST_REWARD_ENV"
    monkeypatch.delenv(name, raising=False)
    with RewardPool(workers=1, timeout_s=5.0) as pool:  # starts the forkserver, if the platform has one
        pool.submit(1, _env, name)
        assert _collect(pool, 1)[1].correct is False
    monkeypatch.setenv(name, "four")
    with RewardPool(workers=1, timeout_s=5.0) as pool:
        pool.submit(1, _env, name)
        got = _collect(pool, 1)[1]
    assert not got.error and got.correct and got.reward == 4.0


def test_an_unpicklable_reward_is_named():
    with RewardPool(workers=1, timeout_s=5.0) as pool:
        pool.submit(1, lambda: (1.0, True))
        pool.submit(2, _slow, 0.0)
        got = _collect(pool, 2)
    assert "cannot be sent to a worker process" in got[1].error and "module level" in got[1].error
    assert not got[2].error


def test_a_shared_task_is_sent_once_per_worker():
    """The task every call shares reaches each worker once; later calls refer to it."""
    from dora_jax.tasks.base import score_answer

    task = ArithmeticTask(seed=0, eval_size=400)  # its held-out set makes it tens of kB
    item = task.train_item(0)
    big = len(pickle.dumps(task))
    got, sent = {}, [0]
    with RewardPool(workers=1, timeout_s=5.0) as pool:
        for k in range(3):  # one call at a time, all to the one worker
            pool.submit(k, score_answer, task, item, item.answer)
            got.update(_collect(pool, 1))
            sent.append(pool.sent_bytes)
    first, *again = [b - a for a, b in zip(sent, sent[1:])]
    assert first > big and all(n < big / 20 for n in again), (big, sent)
    assert sorted(got) == [0, 1, 2] and all(r.reward == 1.0 and r.correct for r in got.values())


def test_metrics_file_and_plots(tmp_path):
    w = MetricsWriter(str(tmp_path), tensorboard=False)
    for step in (1, 2, 3):
        w.write({"step": step, "wall_s": float(step), "reward": step / 10, "accuracy": step / 20,
                 "staleness": {"0": 3, "1": step}, "in_flight": {str(step - 1): 4, str(step): 8},
                 "train": {"loss": 0.5}})
    w.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2, 3] and math.isclose(rows[2]["reward"], 0.3)
    paths = plot_run(str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["reward.png", "staleness.png", "versions.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(MetricsError, match="nowhere: no such run directory"):
        read_metrics(str(tmp_path / "nowhere"))


def test_bad_metrics_files_are_named(tmp_path, caplog):
    with pytest.raises(MetricsError, match="no metrics.jsonl"):
        read_metrics(str(tmp_path))
    path = tmp_path / "metrics.jsonl"
    path.write_text("")
    with pytest.raises(MetricsError, match="metrics.jsonl has no updates to plot"):
        plot_run(str(tmp_path))
    row = {"step": 1, "wall_s": 1.0, "reward": 0.5, "accuracy": 0.5, "staleness": {"0": 2}, "in_flight": {"1": 2}}
    # A run killed while writing: the cut-short last line (no newline after it) is left out, with a warning.
    path.write_text(json.dumps(row) + "\n" + json.dumps(dict(row, step=2))[:20])
    with caplog.at_level("WARNING", logger="dora_jax.metrics"):
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [1]
    assert "metrics.jsonl:2: the last line is cut short" in caplog.text
    # The same damage anywhere else is an error naming the line.
    path.write_text(json.dumps(row)[:20] + "\n" + json.dumps(row) + "\n")
    with pytest.raises(MetricsError, match=r"metrics.jsonl:1: not valid JSON"):
        read_metrics(str(tmp_path))
    path.write_text(json.dumps(row) + "\n[1, 2]\n")
    with pytest.raises(MetricsError, match=r"metrics.jsonl:2: expected a JSON object, got list"):
        read_metrics(str(tmp_path))
    path.write_text(json.dumps(row) + "\n" + json.dumps({"step": 2}) + "\n")
    with pytest.raises(MetricsError, match=r"update 2: no wall_s, reward, accuracy, staleness, in_flight"):
        plot_run(str(tmp_path))
    path.write_bytes(json.dumps(row).encode() + b"\n\xff\n")
    with pytest.raises(MetricsError, match=r"metrics.jsonl: line 2 is not UTF-8 text"):
        read_metrics(str(tmp_path))
