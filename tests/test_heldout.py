"""``dora-jax eval``: held-out accuracy and pass@k of weights on a task, and of a run's newest checkpoint, on the
tiny_llama preset."""

import collections
import json
import os
import zlib

from dora_jax.cli import main
from dora_jax.run import evaluation

MESH = ["mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"]
SMALL_EVAL = ["task.eval_size=4", "task.eval_max_new_tokens=8", "rollout.max_new_tokens=8", "rollout.max_prompt_len=64",
              "train.max_response_tokens=8", "train.length_buckets=[128]"]


def score_by_text(task, item, text):
    """Correct by a fixed function of the answer's text; each call appends ``prompt<TAB>correct`` to the file
    named by ``DORA_TEST_SCORE_LOG`` (rewards run in worker processes: a file is what they share)."""
    correct = zlib.crc32(text.encode()) % 2 == 0
    with open(os.environ["DORA_TEST_SCORE_LOG"], "a") as f:
        f.write(f"{json.dumps(item.prompt)}\t{int(correct)}\n")
    return task.score(item, text).reward, correct


def test_pass_at_k_of_weights(tmp_path, capsys, monkeypatch):
    """Four questions, three sampled answers each; an answer is scored correct by a fixed function of its
    text, recorded here: accuracy is the share of correct answers, pass@3 the share of questions with one."""
    log = tmp_path / "scores.tsv"
    monkeypatch.setenv("DORA_TEST_SCORE_LOG", str(log))
    monkeypatch.setattr(evaluation, "score", score_by_text)
    out = tmp_path / "eval.json"
    assert main(["eval", "--config", "tiny_llama", *MESH, *SMALL_EVAL, "task.eval_samples=3",
                 "task.eval_temperature=1.0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    seen = collections.defaultdict(list)
    for line in log.read_text().splitlines():
        prompt, correct = line.split("\t")
        seen[json.loads(prompt)].append(bool(int(correct)))
    assert (result["weights"], result["task"], result["n"], result["k"]) == ("random init", "arithmetic", 12, 3)
    assert len(seen) == 4 and all(len(v) == 3 for v in seen.values())
    assert result["accuracy"] == sum(map(sum, seen.values())) / 12
    assert result["pass_at_k"] == sum(any(v) for v in seen.values()) / 4
    assert 0 < result["accuracy"] < result["pass_at_k"]  # the two differ here: some questions have 1 or 2 of 3
    assert f"pass@3 {result['pass_at_k']:.3f} over 4 held-out questions" in capsys.readouterr().out


def test_eval_of_a_runs_checkpoint_matches_its_own_final_evaluation(tmp_path, capsys):
    """The newest checkpoint of a finished run, evaluated with the run's config.json, gives the accuracy the
    run measured after its last update (greedy: the same tokens)."""
    run_dir = tmp_path / "run"
    assert main(["train", "--config", "tiny_llama", "--run-dir", str(run_dir), "--no-plot", *MESH, *SMALL_EVAL,
                 "dora.mode=sync", "dora.steps=1", "dora.train_batch=8", "dora.rollout_batch=8",
                 "train.group_size=4", "rollout.slots=8", "run.checkpoint_every=1"]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    capsys.readouterr()
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(run_dir), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["version"] == summary["steps"] == 1 and result["checkpoint"].endswith("step_00000001")
    assert (result["accuracy"], result["reward"], result["n"]) == (summary["accuracy_after"], summary["reward_after"],
                                                                   summary["eval_n"])
    assert result["pass_at_k"] == result["accuracy"] and result["k"] == 1  # one greedy answer a question
    # Bad input is named: --config with --checkpoint, a directory that is not a run's, a run without checkpoints.
    assert main(["eval", "--checkpoint", str(run_dir), "--config", "tiny_llama"]) == 2
    assert "the run's own config.json and checkpoint give the model" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path)]) == 2
    assert f"--checkpoint {tmp_path}: no config.json there" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((run_dir / "config.json").read_text())
    assert main(["eval", "--checkpoint", str(bare)]) == 2
    assert "no run checkpoint in" in capsys.readouterr().err
