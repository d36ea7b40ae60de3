"""`dora-jax bench engine` (benchmarks/engine.py) on a tiny random config, and the matmul-only ceiling it
reports (benchmarks/rates.py)."""

import jax
import pytest
from flax import nnx


def test_bench_engine_reports_every_part():
    """`dora-jax bench engine` on a tiny random config (no tokenizer: random prompts sharing a 16-token head,
    no transformers side): the JSON holds every figure the benchmark promises, consistent with each other."""
    from benchmarks.engine import bench_engine

    out = bench_engine("tiny_llama", batch=4, new_tokens=8, tail_requests=8, tail_slots=4, group_size=2, rounds=2)
    for key in ("engine_tok_s", "roofline_tok_s", "continuous_tok_s", "static_tok_s", "group_prefill_tok_s",
                "single_prefill_tok_s", "overlap_tok_s", "no_overlap_tok_s", "overlap_tail_tok_s",
                "no_overlap_tail_tok_s", "prefix_continuous_tok_s", "no_prefix_continuous_tok_s",
                "prefix_static_tok_s", "no_prefix_static_tok_s"):
        assert out[key] > 0, key
    assert out["shared_prefix_tokens"] == 16
    runs = out["fixed_batch_runs"]  # the fixed batch timed `rounds` times, the best reported
    assert list(runs) == ["engine_tok_s"] and len(runs["engine_tok_s"]) == 2
    assert out["engine_tok_s"] == max(runs["engine_tok_s"])
    assert out["continuous_tok_s"] == max(out["long_tail_runs"]["continuous_tok_s"])
    assert out["static_tok_s"] == max(out["long_tail_runs"]["static_tok_s"])
    assert out["continuous_vs_static"] == pytest.approx(out["continuous_tok_s"] / out["static_tok_s"])
    for name in ("prefix", "no_prefix"):
        assert out[f"{name}_continuous_vs_static"] == pytest.approx(out[f"{name}_continuous_tok_s"]
                                                                    / out[f"{name}_static_tok_s"])
    assert "hf_tok_s" not in out and out["overlap"] is (jax.devices()[0].platform != "cpu")  # the default
    assert out["roofline_fraction"] == pytest.approx(out["engine_tok_s"] / out["roofline_tok_s"])
    assert out["overlap_vs_none"] == pytest.approx(out["overlap_tok_s"] / out["no_overlap_tok_s"])
    assert out["overlap_tail_vs_none"] == pytest.approx(out["overlap_tail_tok_s"] / out["no_overlap_tail_tok_s"])
    util = out["slot_utilization"]
    assert 0 < util["static"] < util["continuous"] <= 1  # the static batch waits for its longest member
    # The matmul ceiling: its ratios follow from its own figures.
    assert out["engine_vs_matmul_only"] == pytest.approx(out["engine_tok_s"] / out["matmul_only_tok_s"])
    assert out["matmul_only_vs_decode_roofline"] == pytest.approx(out["matmul_only_tok_s"]
                                                                  / out["decode_only_roofline_tok_s"])
    assert "matmul_only_vs_hf" not in out and "torch_matmul_only_step_ms" not in out
    # Several decode steps per program (rollout.decode_steps "auto": 8) against one: the fixed batch's 7
    # decode steps (the first token comes from prefill) run in one dispatch.
    assert out["decode_steps"] == 8
    assert out["decode_steps_per_dispatch"] == out["decode_steps_per_dispatch_median"] == 7
    assert 1 <= out["tail_decode_steps_per_dispatch"] <= 8
    for name in ("", "tail_"):
        assert out[f"multi_step_{name}vs_one"] == pytest.approx(out[f"multi_step_{name}tok_s"]
                                                                / out[f"one_step_{name}tok_s"])


def test_matmul_chain_covers_every_weight_matmul_of_a_step():
    """The matmul-only ceiling times exactly the step's weight matmuls: 2 FLOPs per row per parameter of the
    model less its norms and, when the head has its own weights, the embedding table (a lookup, not a matmul),
    whatever the config's shapes."""
    from benchmarks.rates import measure_matmul_chain
    from dora_jax.config import load_config
    from dora_jax.models.weights import load_model

    for overrides in ([], ["model.num_heads=8", "model.num_kv_heads=2", "model.intermediate_size=96",
                           "model.tie_embeddings=true"]):
        cfg = load_config("tiny_llama", overrides).model
        model, _ = load_model(cfg, progress=False)
        n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
        norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
        lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
        out = measure_matmul_chain(cfg, batch=3, rounds=1)
        assert out["matmul_only_flops"] == 2 * 3 * (n_params - norms - lookup)
        assert out["matmul_only_tok_s"] == pytest.approx(3e3 / out["matmul_only_step_ms"])
