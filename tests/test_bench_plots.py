"""``bench modes`` and ``bench convergence`` results as drawn (titles, labelled axes, every mode or run shown), and
their command-line options, from small synthetic results (the benchmarks themselves take minutes to hours)."""

import matplotlib

matplotlib.use("Agg")

import json  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from benchmarks import cli, convergence, modes, workload  # noqa: E402


def modes_result():
    names = ["sync", "one_step_off", "dora_k2", "sync_shared", "dora_k2_shared"]
    return {"steps": 3, "repeats": 2, "train_batch": 16, "device": "test device", "simulator": {"target": 0.15},
            "sync_reward_spread": {"mean": [0.1, 0.2, 0.3], "min": [0.0, 0.1, 0.2], "max": [0.2, 0.3, 0.4]},
            "sync_reward_curves": [[0.1, 0.2, 0.3]] * 2,
            "modes": {n: {"reward_per_step": [0.1, 0.2, 0.3], "samples_per_s": 10.0 + i, "measured_wall_s": 2.0 + i,
                          "simulated_wall_s": 2.1 + i, "decode_steps_per_sample": 8.0 - i,
                          "runs": {"samples_per_s": [9.0 + i, 11.0 + i], "wall_s": [1.9 + i, 2.2 + i]}}
                      for i, n in enumerate(names)}}


def drawn(monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    return figures, close


def test_modes_plot_has_titles_labels_and_every_mode(tmp_path, monkeypatch):
    figures, close = drawn(monkeypatch)
    path = modes.plot_modes(modes_result(), str(tmp_path / "modes.png"))
    assert (tmp_path / "modes.png").stat().st_size > 0 and path.endswith("modes.png")
    (fig,) = figures
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    walls, steps = fig.axes[2], fig.axes[3]
    names = ["sync", "one_step_off", "dora_k2", "sync_shared", "dora_k2_shared"]
    assert [t.get_text() for t in walls.get_xticklabels()] == names
    assert len(walls.patches) == 10  # measured and simulated, per mode
    # Each mode against sync under its own placement: dora_k2 7/8 of sync, dora_k2_shared 4/5 of sync_shared.
    assert [p.get_height() for p in steps.patches] == pytest.approx([1.0, 7 / 8, 6 / 8, 1.0, 4 / 5])
    close(fig)



def test_modes_plot_of_a_run_that_simulated_nothing_shows_the_measured_wall_times_alone(tmp_path, monkeypatch):
    figures, close = drawn(monkeypatch)
    result = modes_result()
    result["simulator"] = None
    for r in result["modes"].values():
        del r["simulated_wall_s"]
    modes.plot_modes(result, str(tmp_path / "modes.png"))
    (fig,) = figures
    walls = fig.axes[2]
    assert len(walls.patches) == 5 and "not simulated" in walls.get_title()
    close(fig)


def test_modes_runs_a_chosen_subset_that_holds_sync_and_dora_k2():
    assert [v.name for v in modes.plan(False)] == list(modes.MODE_NAMES)
    assert [v.name for v in modes.plan(False, ("dora_k3", "sync", "dora_k2"))] == ["sync", "dora_k2", "dora_k3"]
    assert [v.name for v in modes.plan(True, ("sync", "dora_k2"))] == ["sync", "dora_k2", "sync_shared",
                                                                         "dora_k2_shared"]
    with pytest.raises(ValueError, match="sync and dora_k2"):
        modes.plan(False, ("sync", "dora_k3"))
    with pytest.raises(ValueError, match=r"unknown: \['dora_k9'\]"):
        modes.plan(False, ("sync", "dora_k2", "dora_k9"))
    args = cli.build_parser().parse_args(["modes", "--modes", "sync,dora_k2", "--no-simulate"])
    assert (args.modes, args.no_simulate) == ("sync,dora_k2", True)
    # Refused before anything is built: a bad selection, the options on another benchmark, a profile with nothing
    # to simulate.
    assert cli.main(["modes", "--modes", "sync,one_step_off"]) == 2
    assert cli.main(["engine", "--modes", "sync,dora_k2"]) == 2 and cli.main(["train", "--no-simulate"]) == 2
    assert cli.main(["modes", "--no-simulate", "--profile", "p.json"]) == 2

def test_convergence_plot_has_titles_labels_and_every_run(tmp_path, monkeypatch):
    runs = {n: {"reward_mean": [0.1, 0.2], "reward_stderr": [0.01, 0.02], "accuracy_before": [0.1, 0.1],
                "final_accuracy_stats": {"mean": 0.3, "stderr": 0.05}} for n, _ in convergence.RUNS}
    figures, close = drawn(monkeypatch)
    convergence.plot_convergence({"runs": runs, "seeds": 2, "samples_per_run": 32, "heldout_answers": 256},
                                 str(tmp_path / "conv.png"))
    (fig,) = figures
    rewards, accuracy = fig.axes
    for ax in fig.axes:
        assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert len(rewards.get_lines()) == len(convergence.RUNS) and len(accuracy.patches) == len(convergence.RUNS)
    assert [h.get_label()[:15] for h in _levels(accuracy)] == ["before training"]  # no target: no floor drawn
    close(fig)
    convergence.plot_convergence({"runs": runs, "seeds": 2, "samples_per_run": 32, "heldout_answers": 256,
                                  "target": {"floor": 0.25}}, str(tmp_path / "conv.png"))
    (fig,) = figures[1:]
    assert [h.get_ydata()[0] for h in _levels(fig.axes[1])] == [pytest.approx(0.1), 0.25]
    close(fig)


def _levels(ax):
    """The horizontal reference lines of an axes (the error bars' lines are not labelled)."""
    return [h for h in ax.get_lines() if not h.get_label().startswith("_")]


def _convergence_file(path, names, accuracies, **changes):
    """A ``bench convergence`` result as written by the main job's recipe, each run name's seeds at
    ``accuracies``."""
    runs = {n: {"final_accuracy": a, "reward_per_iteration": [[0.1, 0.2]] * len(a), "accuracy_before": [0.1] * len(a),
                "final_accuracy_stats": convergence.seed_stats(a), "reward_mean": [0.1, 0.2],
                "reward_stderr": [0.0, 0.0]}
            for n, a in zip(names, accuracies)}
    result = {"command": "dora-jax bench convergence --decoupled-cap 5 train.minibatches=4 --json x.json",
              "device": "CPU, 2 cores", "date": "2026-11-26", "config": "smollm2_arith", "seeds": 4, "steps": 20,
              "train_batch": 32, "samples_per_run": 640, "eval_size": 128, "eval_samples": 2, "heldout_answers": 256,
              "runs": runs, "settings": {n: [f"setting of {n}"] for n in names}}
    result.update(changes)
    path.write_text(json.dumps(result))
    return str(path)


def test_convergence_results_of_one_recipe_merge_into_one_comparison(tmp_path, monkeypatch):
    a = _convergence_file(tmp_path / "a.json", ["dora_k3_decoupled"], [[0.55, 0.57, 0.59, 0.57]])
    b = _convergence_file(tmp_path / "b.json", ["sync", "dora_k2_decoupled"],
                          [[0.5, 0.6, 0.6, 0.7], [0.5, 0.52, 0.5, 0.5]],
                          command="dora-jax bench convergence train.minibatches=4 --decoupled-cap 5.0",
                          overrides=["train.minibatches=4"], decoupled_cap=5.0)
    out = convergence.merge([a, b])
    assert list(out["runs"]) == ["sync", "dora_k2_decoupled", "dora_k3_decoupled"]  # the benchmark's own order
    # sync: mean 0.6, SE = std(ddof=1) / 2 = 0.08165 / 2, floor 0.6 - 0.08165 = 0.5184
    assert out["target"]["floor"] == pytest.approx(0.6 - np.std([0.5, 0.6, 0.6, 0.7], ddof=1))
    assert out["target"]["met"] == {"dora_k2_decoupled": False, "dora_k3_decoupled": True}
    assert out["settings"]["sync"] == ["setting of sync"] and out["measured_on"] == "CPU, 2 cores"
    assert (out["overrides"], out["decoupled_cap"]) == (["train.minibatches=4"], 5.0)
    assert [m["runs"] for m in out["merged_from"]] == [["dora_k3_decoupled"], ["sync", "dora_k2_decoupled"]]
    json.dumps(out)

    def refused(paths, match):
        with pytest.raises(ValueError, match=match):
            convergence.merge(paths)

    other_steps = _convergence_file(tmp_path / "c.json", ["sync"], [[0.5, 0.6]], steps=40)
    refused([a, other_steps], f"steps differs: 20 in {a}, 40 in {other_steps}")
    other_rate = _convergence_file(tmp_path / "d.json", ["sync"], [[0.5, 0.6]],
                                   command="dora-jax bench convergence --decoupled-cap 5 train.minibatches=4 "
                                           "train.learning_rate=1e-5")
    refused([a, other_rate], "the recipe differs")
    no_cap = _convergence_file(tmp_path / "e.json", ["sync"], [[0.5, 0.6]],
                               command="dora-jax bench convergence train.minibatches=4")
    refused([a, no_cap], "the recipe differs")
    refused([a, _convergence_file(tmp_path / "f.json", ["sync"], [[0.5]], device="NVIDIA H100")], "device differs")
    refused([b, _convergence_file(tmp_path / "g.json", ["sync"], [[0.5, 0.6]])], f"'sync' is in both {b}")
    (tmp_path / "h.json").write_text("{not json")
    refused([a, str(tmp_path / "h.json")], "h.json: not readable as JSON")
    (tmp_path / "i.json").write_text(json.dumps({"modes": {}}))
    refused([a, str(tmp_path / "i.json")], "i.json: not a bench convergence result")
    refused([a], "two or more")
    # On the command line: a bad merge is an error naming the file, not a traceback; --merge trains nothing.
    assert cli.main(["convergence", "--merge", f"{a},{other_steps}"]) == 2
    assert cli.main(["convergence", "--merge", f"{a},{b}", "--runs", "sync"]) == 2
    assert cli.main(["convergence", "--merge", f"{a},{b}", "train.minibatches=2"]) == 2
    assert cli.main(["modes", "--merge", f"{a},{b}"]) == 2
    monkeypatch.setattr(convergence, "bench_convergence", lambda *a, **k: pytest.fail("trained"))
    assert cli.main(["convergence", "--merge", f"{a},{b}", "--json", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["target"]["met"]["dora_k3_decoupled"] is True


def test_convergence_target_by_hand():
    # sync: mean 0.40, standard error 0.02 (seeds 0.38, 0.42): the floor is 0.36.
    runs = {"sync": {"final_accuracy_stats": convergence.seed_stats([0.38, 0.42])},
            "dora_k2_none": {"final_accuracy_stats": convergence.seed_stats([0.1, 0.1])},
            "dora_k2_decoupled": {"final_accuracy_stats": convergence.seed_stats([0.36, 0.37])},
            "dora_k3_decoupled": {"final_accuracy_stats": convergence.seed_stats([0.35, 0.36])}}
    out = convergence.parity(runs)
    assert out["floor"] == pytest.approx(0.36)
    assert out["met"] == {"dora_k2_decoupled": True, "dora_k3_decoupled": False}


def test_convergence_runs_a_chosen_subset_with_the_cap_on_decoupled_runs_only(monkeypatch, tmp_path):
    """``--runs`` trains only the names given, ``--decoupled-cap`` reaches the decoupled runs' settings and no
    other's, and a result without sync says it has no floor. The harness is replaced by one that records what
    it was asked to train."""
    trained = []

    class Recorder:
        def __init__(self, config, overrides, out_dir):
            self.out_dir = str(tmp_path)

        def run(self, v, extra):
            trained.append((v.name, list(v.overrides), list(extra)))
            row = {"reward": 0.5, "train": {"clip_frac": 0.1, "grad_norm": 1.0}, "staleness_max": 1}
            return {"summary": {"accuracy_before": 0.1, "accuracy_after": 0.3, "reward_after": 0.5, "samples": 32,
                                "eval_n": 256, "wall_s": 1.0}, "rows": [row]}

        def forget(self):
            pass

    monkeypatch.setattr(convergence, "Harness", Recorder)
    out = convergence.bench_convergence(seeds=2, names=("dora_k3_decoupled", "dora_k2_none"), decoupled_cap=5.0)
    assert list(out["runs"]) == ["dora_k2_none", "dora_k3_decoupled"]  # RUNS' order, only those asked for
    caps = {name: [o for o in ov if o.startswith("train.decoupled_cap")] for name, ov, _ in trained}
    assert caps == {"dora_k2_none": [], "dora_k3_decoupled": ["train.decoupled_cap=5.0"]}
    assert [extra for _, _, extra in trained] == [["rollout.seed=0"], ["rollout.seed=1"]] * 2
    assert out["target"] == {"floor": None, "met": {}, "why": "no sync run in this result"}
    with pytest.raises(ValueError, match="unknown run names \\['dora_k9'\\]"):
        convergence.bench_convergence(names=("dora_k9",))


def test_the_reasoning_preset_is_a_valid_run_of_reasoning_length():
    from dora_jax.config import load_config

    r = modes.REASONING
    cfg = load_config(r["config"], workload.workload(r["max_len"]) + r["overrides"])
    assert cfg.model.weights == "" and cfg.model.compute_dtype == "bfloat16"  # random weights: byte tokens, no EOS
    assert cfg.rollout.max_new_tokens == cfg.train.max_response_tokens == cfg.task.longtail_max_len == 4096
    assert cfg.model.max_seq_len >= cfg.rollout.max_prompt_len + 4096 and max(cfg.train.length_buckets) >= 4096 + 32
    assert workload.workload(256) == workload.OVERRIDES
    assert "train.length_buckets=[64, 128, 192, 256, 320]" in workload.OVERRIDES
    # The profile's decode grid is a subset of the default one's points, swept fewer times.
    import inspect

    from benchmarks.profile import BATCHES, VERSIONS, bench_profile

    grid = r["profile_grid"]
    assert set(grid) <= set(inspect.signature(bench_profile).parameters)
    assert set(grid["batches"]) <= set(BATCHES) and set(grid["versions"]) <= set(VERSIONS) and grid["rounds"] >= 1


def test_bench_options():
    args = cli.build_parser().parse_args(["convergence", "--seeds", "2", "--steps", "3", "--eval-size", "128"])
    assert (args.seeds, args.steps, args.eval_size) == (2, 3, 128)
    args = cli.build_parser().parse_args(["modes", "--profile", "p.json", "--repeats", "5", "--warm-rounds", "1"])
    assert (args.profile, args.repeats, args.warm_rounds) == ("p.json", 5, 1)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["convergence", "--seeds", "0"])
    assert "profile" in cli.WHAT and "convergence" in cli.WHAT
    assert cli.main(["convergence", "--preset", "reasoning"]) == 2 and cli.main(["modes", "--preset", "accel"]) == 2


def test_simulated_against_measured_by_hand():
    # Measured medians as numpy floats (what np.median gives): every figure must still be plain JSON.
    results = {"sync": {"mode": "sync", "measured_wall_s": np.float64(4.0)},
               "one_step_off": {"mode": "one_step_off", "measured_wall_s": np.float64(3.0)},
               "dora_k2": {"mode": "dora", "measured_wall_s": np.float64(2.0)}}
    simulated = {"sync": {"wall_s": 4.4}, "one_step_off": {"wall_s": 2.4}, "dora_k2": {"wall_s": 1.8}}
    out = modes.compare(results, simulated)
    assert results["sync"]["simulated_error"] == pytest.approx(0.1)
    assert results["one_step_off"]["simulated_error"] == pytest.approx(-0.2)
    assert out["wall_within_target"] == {"sync": True, "one_step_off": False, "dora_k2": True}
    # Each wall time within 15% (+10%, -10%), yet dora / sync: measured 0.5, simulated 1.8 / 4.4 = 0.409, 18% low.
    ratio = out["dora_over_sync_wall"]["dora_k2"]
    assert (ratio["measured"], ratio["simulated"]) == (pytest.approx(0.5), pytest.approx(1.8 / 4.4))
    assert ratio["error"] == pytest.approx(-0.18182, abs=1e-5) and out["ratio_within_target"] == {"dora_k2": False}
    json.loads(json.dumps({"results": results, "simulator": out}))
    # A shared-placement dora run is compared with the shared sync run, not with the split one.
    results["sync_shared"] = {"mode": "sync", "measured_wall_s": 8.0}
    results["dora_k2_shared"] = {"mode": "dora", "measured_wall_s": 4.0}
    simulated.update(sync_shared={"wall_s": 8.0}, dora_k2_shared={"wall_s": 2.0})
    out = modes.compare(results, simulated)
    assert out["dora_over_sync_wall"]["dora_k2_shared"]["measured"] == pytest.approx(0.5)
    assert out["dora_over_sync_wall"]["dora_k2_shared"]["simulated"] == pytest.approx(0.25)


def _mode_run(wall, compile_s, steps_per_sample=4.0):
    summary = {"mode": "dora", "placement": "shared", "max_staleness": 2, "samples": 128, "wall_s": wall,
               "decode_batch_steps_per_sample": steps_per_sample, "slot_utilization": 0.5, "decode_batch_steps": 512,
               "train_s": 1.0, "gen_tok_s": 10.0, "trainer_idle_fraction": 0.1, "max_resident_versions": 3,
               "sync_s": 0.0, "samples_per_s": 128 / wall}
    rows = [{"staleness": {"1": 16}, "rollout_share": 0.5, "slot_occupancy": 0.5, "trained_tokens": 640,
             "reward": 0.5, "len_p50": 8, "len_p99": 200}]
    return {"summary": summary, "rows": rows, "compile_s": compile_s}


def test_modes_without_simulation_measures_no_profile(monkeypatch):
    import benchmarks.profile

    class FakeHarness:  # the runs' figures by hand: sync 4 s and 8 steps a sample, dora_k2 2 s and 2
        split, device_count, out_dir = False, 1, "/nowhere"

        def __init__(self, *a, **k):
            self.warmed = []

        def warm(self, phase, max_rounds):
            self.warmed.append([v.name for v in phase])
            return [0]

        def cfg(self, extra=(), split=False):
            return types.SimpleNamespace(rollout=types.SimpleNamespace(slots=32))

        def rounds(self, phase, repeats, on_run=None):
            return {v.name: [_mode_run(4.0, 0.0, 8.0) if v.name == "sync" else _mode_run(2.0, 0.0, 2.0)]
                    for v in phase}

        def forget(self):
            pass

    def no_profile(*a, **k):
        raise AssertionError("a profile was measured")

    monkeypatch.setattr(modes, "Harness", FakeHarness)
    monkeypatch.setattr(benchmarks.profile, "bench_profile", no_profile)
    out = modes.bench_modes(modes=("sync", "dora_k2"), simulate=False, noise_seeds=1, repeats=1)
    assert out["simulator"] is None and out["profile"] is None and list(out["modes"]) == ["sync", "dora_k2"]
    assert out["speedup_vs_sync"]["dora_k2"] == pytest.approx(2.0)
    assert out["target"]["decode_steps_per_sample_vs_sync"] == pytest.approx(0.25) and out["target"]["met"]
    json.dumps(out)


def test_a_mode_wall_time_leaves_out_what_compiled_inside_the_run():
    run = _mode_run

    # Walls 2.0, 5.0 (3.0 of it compiling) and 2.4: net 2.0, 2.0, 2.4, so the median is 2.0, not 2.4.
    r = modes.mode_result("dora_k2", [run(2.0, 0.0), run(5.0, 3.0), run(2.4, 0.0)])
    assert r["measured_wall_s"] == pytest.approx(2.0) and r["runs"]["wall_with_compile_s"] == [2.0, 5.0, 2.4]
    assert r["samples_per_s"] == pytest.approx(64.0) and r["runs"]["compile_s"] == [0.0, 3.0, 0.0]
