"""Data-driven tasks from local files (JSONL, JSON, parquet), field mapping, bad rows named, and the math-verify
reward. Nothing here touches the network."""

import json

import pytest

from dora_jax.config import ConfigError, TaskConfig, load_config
from dora_jax.rewards import RewardPool
from dora_jax.tasks import GSM8KTask, MathTask, TaskDataError, load_task, math_reward
from dora_jax.tasks.base import score_answer

GSM8K = [{"question": f"Tom has {i} apples and buys {i + 1} more. How many now?",
          "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"} for i in range(6)]
MATH = [{"problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?", "solution": "We get $\\boxed{\\frac{3}{4}}$.",
         "level": "Level 1", "type": "Algebra"},
        {"problem": "Simplify $\\sqrt{8}$.", "solution": "$\\sqrt{8} = \\boxed{2\\sqrt{2}}$", "level": "Level 2",
         "type": "Algebra"},
        {"problem": "Expand $(x+1)^2 - 2x$.", "solution": "The result is $\\boxed{x^2+1}$.", "level": "Level 2",
         "type": "Algebra"},
        {"problem": "What is $6 \\cdot 7$?", "solution": "$\\boxed{42}$", "level": "Level 1", "type": "Prealgebra"}]
# DAPO-Math-17k / verl layout: the prompt is a chat, the answer nested under reward_model.
DAPO = [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"Compute {i} squared. Answer: $x$"}],
         "reward_model": {"ground_truth": str(i * i), "style": "rule-lab"}} for i in range(2, 7)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _parquet(path, rows):
    pa = pytest.importorskip("pyarrow", reason="parquet files need the [data] extra (datasets, pyarrow)")
    pytest.importorskip("datasets", reason="parquet files are read through the [data] extra (datasets)")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _prompts(task, rows):
    """The prompts of a task read from ``rows`` rows: its training items (the rows not held out) and the held-out
    ones."""
    return sorted(task.train_item(i).prompt for i in range(rows - len(task.eval_items()))) + sorted(
        it.prompt for it in task.eval_items())


def test_gsm8k_from_jsonl_json_and_parquet(tmp_path):
    tasks = [GSM8KTask(_jsonl(tmp_path / "g.jsonl", GSM8K), eval_size=2)]
    (tmp_path / "g.json").write_text(json.dumps(GSM8K))
    tasks.append(GSM8KTask(str(tmp_path / "g.json"), eval_size=2))
    tasks.append(GSM8KTask(_parquet(tmp_path / "g.parquet", GSM8K), eval_size=2))
    for task in tasks:
        assert sorted(_prompts(task, len(GSM8K))) == sorted(r["question"] for r in GSM8K)
        item = task.eval_items()[0]
        assert task.score(item, f"So the total is {item.answer}.").correct
        assert not task.score(item, "I think 1000.").correct
        assert task.train_item(0) == tasks[0].train_item(0)  # the same seeded split whatever the file kind


def test_math_task_from_math_and_dapo_layouts(tmp_path):
    task = MathTask(_jsonl(tmp_path / "math.jsonl", MATH), eval_size=1)
    items = {it.prompt: it for it in task.eval_items() + [task.train_item(i) for i in range(3)]}
    frac = items["What is $\\frac{1}{2} + \\frac{1}{4}$?"]
    assert task.score(frac, "Adding gives \\boxed{0.75}").correct
    assert task.score(frac, "The answer is $\\dfrac{3}{4}$.").correct
    assert not task.score(frac, "\\boxed{\\frac{2}{3}}").correct
    assert task.score(items["Simplify $\\sqrt{8}$."], "\\boxed{\\sqrt{8}}").correct
    assert task.score(items["Expand $(x+1)^2 - 2x$."], "\\boxed{1 + x^2}").correct
    dapo = MathTask(_jsonl(tmp_path / "dapo.jsonl", DAPO), eval_size=1)
    item = next(dapo.train_item(i) for i in range(4) if dapo.train_item(i).prompt.startswith("Compute 3 "))
    assert item.answer == "9" and dapo.score(item, "3 squared is 9.\nAnswer: 9").correct
    assert not dapo.score(item, "Answer: 6").correct
    pq = MathTask(_parquet(tmp_path / "dapo.parquet", DAPO), eval_size=1)
    assert sorted(_prompts(pq, len(DAPO))) == sorted(_prompts(dapo, len(DAPO)))


def test_field_mapping(tmp_path):
    rows = [{"q": {"text": f"question {i}?"}, "a": {"final": i}} for i in range(5)]
    task = MathTask(_jsonl(tmp_path / "m.jsonl", rows), eval_size=1, prompt_field="q.text", answer_field="a.final")
    assert sorted(_prompts(task, len(rows))) == [f"question {i}?" for i in range(5)]
    with pytest.raises(TaskDataError, match=r"m.jsonl:1: needs a non-empty prompt in field 'question'"):
        MathTask(str(tmp_path / "m.jsonl"), eval_size=1, prompt_field="question", answer_field="a.final")


@pytest.mark.parametrize("rows,message", [
    ([GSM8K[0], {"question": "no answer"}], r"bad.jsonl:2: needs an answer in field 'answer'"),
    ([GSM8K[0], {"question": "", "answer": "1"}], r"bad.jsonl:2: needs a non-empty prompt in field 'question' .*found str ''"),
    ([GSM8K[0], ["a", "list"]], r"bad.jsonl:2: expected an object with the question and answer, got list"),
    ([GSM8K[0], {"prompt": [{"role": "system", "content": "x"}], "answer": "1"}],
     r"bad.jsonl:2: needs a non-empty prompt in field 'prompt' \(a string, or a chat with a user message\)"),
    ([GSM8K[0], {"question": "q", "answer": "no number"}], r"bad.jsonl:2: the answer 'no number' has no number"),
])
def test_bad_rows_are_named(tmp_path, rows, message):
    with pytest.raises(TaskDataError, match=message):
        GSM8KTask(_jsonl(tmp_path / "bad.jsonl", rows), eval_size=0)


def test_bad_files_are_named(tmp_path):
    (tmp_path / "x.json").write_text('{"rows": []}')
    with pytest.raises(TaskDataError, match=r"x.json: expected a JSON list of objects"):
        MathTask(str(tmp_path / "x.json"), eval_size=0)
    (tmp_path / "x.json").write_text('[{"problem": "p", "answer": "1"}, {"problem": "p2"}]')
    with pytest.raises(TaskDataError, match=r"x.json: row 1: needs an answer in field 'answer / solution"):
        MathTask(str(tmp_path / "x.json"), eval_size=0)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(TaskDataError, match=r"x.csv' is a file of a kind dora-jax does not read"):
        MathTask(str(tmp_path / "x.csv"), eval_size=0)
    with pytest.raises(TaskDataError, match=r"'data/missing.parquet' does not exist"):
        MathTask("data/missing.parquet", eval_size=0)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    pytest.importorskip("datasets", reason="parquet files are read through the [data] extra (datasets)")
    with pytest.raises(TaskDataError, match=r"datasets could not load .*bad.parquet"):
        MathTask(str(bad), eval_size=0)


def test_config_fields(tmp_path):
    path = _jsonl(tmp_path / "dapo.jsonl", DAPO)
    cfg = load_config(None, ["task.name=math", f"task.path={path}", "task.eval_size=1",
                             "task.answer_field=reward_model.ground_truth"]).task
    assert isinstance(load_task(cfg), MathTask)
    with pytest.raises(ConfigError, match=r"'task.path' = '': task 'math' reads its data from here"):
        load_config(None, ["task.name=math"])
    with pytest.raises(ConfigError, match=r"'task.reward' = 'maths': math, an import path"):
        load_config(None, ["task.reward=maths"])
    task = load_task(TaskConfig(name="gsm8k", path=_jsonl(tmp_path / "g.jsonl", GSM8K), eval_size=1, reward="math"))
    item = task.eval_items()[0]
    assert task.score(item, f"\\boxed{{{item.answer}}}").reward == 1.0
    assert task.score(item, "\\boxed{-1}").reward == 0.0


def test_math_reward_cases():
    assert math_reward("", "so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_reward("", "The answer is $x = 3$.", "3") == 1.0
    assert math_reward("", "\\boxed{(1, 2)}", "(1,2)") == 1.0
    assert math_reward("", "\\boxed{5}", "6") == 0.0
    assert math_reward("", "no answer at all", "6") == 0.0
    with pytest.raises(ValueError, match="cannot be parsed by math-verify"):
        math_reward("", "\\boxed{1}", "")


def test_math_reward_runs_in_the_reward_pool(tmp_path):
    """In the pool's worker processes math-verify keeps its own time limits (the worker's main thread)."""
    task = MathTask(_jsonl(tmp_path / "math.jsonl", MATH), eval_size=0)
    with RewardPool(workers=1, timeout_s=30) as pool:
        for k in range(4):
            item = task.train_item(k)
            pool.submit(k, score_answer, task, item, f"\\boxed{{{item.answer}}}" if k % 2 else "\\boxed{7}")
        got = {}
        while len(got) < 4:
            got.update((r.key, r) for r in pool.poll(0.1))
    assert [got[k].correct for k in range(4)] == [False, True, False, True], [got[k].error for k in range(4)]
