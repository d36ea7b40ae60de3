"""``dora-jax bench train``: training tokens/s of the train step and its model FLOP utilization; and the
synthetic batch and fresh trainer the train-step benchmarks (this one and ``bench snapshot``) share."""

from __future__ import annotations

import dataclasses
from typing import Any

from benchmarks.rates import measure_machine
from benchmarks.record import machine
from benchmarks.timing import time_calls


def synthetic_samples(rng, rows: int, prompt_len: int, response_len: int, vocab_size: int) -> list:
    """Random finished samples in groups of 4 with random rewards, the batch the train-step benchmarks time
    (the step's cost does not depend on the tokens).

    Args:
      rng: a numpy generator.
      rows: samples.
      prompt_len, response_len: tokens of each prompt and response.
      vocab_size: token ids are drawn from ``1 .. vocab_size - 1``.

    Returns:
      ``rows`` trainer ``Sample``s.
    """
    from dora_jax.trainer import Sample

    return [Sample(i, i // 4, 0, rng.integers(1, vocab_size, prompt_len).tolist(),
                   rng.integers(1, vocab_size, response_len).tolist(),
                   (-rng.uniform(0.5, 5.0, response_len)).tolist(), float(rng.normal())) for i in range(rows)]


def bench_trainer(cfg, samples: list, seq: int, response_len: int, lora_rank: int, **train_overrides):
    """A fresh model, trainer, state and device batch for the train-step benchmarks.

    Args:
      cfg: the run's ``Config``.
      samples: the batch (:func:`synthetic_samples`).
      seq: the one length bucket (prompt + response tokens).
      response_len: ``train.max_response_tokens``.
      lora_rank: LoRA rank; 0 for full fine-tuning.
      **train_overrides: further ``TrainConfig`` fields.

    Returns:
      ``(run config, trainer, state, device batch)``: groups of 4, one length bucket.
    """
    from dora_jax.config import LoraConfig
    from dora_jax.models.weights import load_model
    from dora_jax.trainer import Trainer, make_batch

    train = dataclasses.replace(cfg.train, group_size=4, length_buckets=(seq,), max_response_tokens=response_len,
                                lora=LoraConfig(rank=lora_rank), **train_overrides)
    run_cfg = dataclasses.replace(cfg, train=train)
    model, _ = load_model(cfg.model, progress=False)
    trainer, state = Trainer.create(run_cfg, model=model)
    del model
    batch = trainer.put(make_batch(samples, group_size=4, length_buckets=(seq,), row_multiple=trainer.row_multiple))
    return run_cfg, trainer, state, batch


def train_flops(model_cfg, tokens: int, seq_len: int, lora: bool) -> float:
    """Model FLOPs of one training step over ``tokens`` tokens in rows of ``seq_len`` (causal attention).

    Matmuls: forward 2 N per token; backward 2 N for input gradients plus, for full fine-tuning, 2 N for weight
    gradients (LoRA's adapters are negligible). Attention scores and values: 4 d_attn per (query, key) pair
    with half the pairs causal, times 3 for forward + backward. N counts the tied head once.

    Args:
      model_cfg: the model's ``ModelConfig``.
      tokens: tokens in the step.
      seq_len: tokens per row.
      lora: LoRA (no weight gradients of the base) rather than full fine-tuning.

    Returns:
      FLOPs.
    """
    c = model_cfg
    d_attn = c.num_heads * c.head_dim
    per_layer = (c.hidden_size * d_attn * 2 + c.hidden_size * c.num_kv_heads * c.head_dim * 2
                 + 3 * c.hidden_size * c.intermediate_size)
    n = c.num_layers * per_layer + c.vocab_size * c.hidden_size
    matmul = (4 if lora else 6) * n * tokens
    attention = 3 * c.num_layers * 4 * d_attn * (seq_len / 2) * tokens
    return float(matmul + attention)


def bench_train(config: str = "smollm2_135m", rows: int = 8, prompt_len: int = 32, response_len: int = 96,
                lora_rank: int = 16, repeats: int = 3, seed: int = 0,
                overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Training tokens/s of the jitted, donated train step, full fine-tuning and LoRA, with model FLOP
    utilization against the matmul rate measured in the same run; best of ``repeats`` steps after compiling.

    Rows are random token sequences (``prompt_len`` + ``response_len``) in groups of 4 with random rewards:
    the step's cost does not depend on the tokens.

    Args:
      config: a shipped preset or YAML file.
      rows: samples per step.
      prompt_len, response_len: tokens of each row's prompt and response.
      lora_rank: the LoRA side's rank.
      repeats: timed steps after the compiling one.
      seed: the synthetic batch.
      overrides: ``key=value`` config overrides.

    Returns:
      Per mode (``full``, ``lora``) the compile time, step time, tokens/s, model FLOPs and MFU;
      ``lora_vs_full``, the machine's measured rates and ``machine``.
    """
    import numpy as np

    from dora_jax.config import load_config

    cfg = load_config(config, overrides)
    rng = np.random.default_rng(seed)
    seq = prompt_len + response_len
    samples = synthetic_samples(rng, rows, prompt_len, response_len, cfg.model.vocab_size)
    machine_rates = measure_machine()
    out: dict[str, Any] = {"config": config, "rows": rows, "seq_len": seq, "tokens_per_step": rows * seq,
                           "response_tokens_per_step": rows * response_len, "lora_rank": lora_rank,
                           **machine_rates}
    for name, rank in (("full", 0), ("lora", lora_rank)):
        run_cfg, trainer, state, batch = bench_trainer(cfg, samples, seq, response_len, rank)
        last = {}

        def step():
            nonlocal state
            state, last["metrics"] = trainer.train_step(state, batch)
            return last["metrics"]

        times = time_calls(step, repeats=repeats + 1, warmup=0)  # the first call compiles
        step_s = min(times[1:])
        flops = train_flops(cfg.model, rows * seq, seq, lora=rank > 0)
        out[name] = {"compile_and_first_step_s": times[0], "step_s": step_s, "tokens_s": rows * seq / step_s,
                     "model_flops": flops, "mfu": flops / step_s / machine_rates["matmul_flop_s"],
                     "skipped": float(last["metrics"]["skipped"])}
        del trainer, state, batch
    out["lora_vs_full"] = out["lora"]["tokens_s"] / out["full"]["tokens_s"]
    out["machine"] = machine()
    return out
