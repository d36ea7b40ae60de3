"""``dora-jax bench train``: training tokens/s of the train step and its model FLOP utilization; and the
synthetic batch and fresh trainer the train-step benchmarks (this one and ``bench snapshot``) share."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

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


# A Qwen2.5-1.5B-shaped model (Hugging Face config.json of Qwen/Qwen2.5-1.5B-Instruct), random weights, float32
# master weights with bf16 compute: the accelerator preset of ``bench train --preset accel``.
ACCEL_MODEL = dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                   num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1000000.0, tie_embeddings=True,
                   qkv_bias=True, param_dtype="float32", compute_dtype="bfloat16")
# The CPU stand-in: the same vocabulary (the logits are what would grow with V x T), a tiny body.
CPU_MODEL = dict(ACCEL_MODEL, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16)
ACCEL_LENGTHS = (2048, 8192, 32768)
CPU_LENGTHS = (1024, 2048, 4096, 8192)
# Dense bf16 peak FLOP/s by device kind (vendor data sheets, SXM forms): MFU's denominator where known.
BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
LONG_SETTINGS = dict(remat="full", attention_impl="auto", attention_block=512)
PLAIN_SETTINGS = dict(remat="none", attention_impl="xla", logprob_chunk=0)


def _length_config(model: dict, seq: int, rows: int, train: dict):
    """A config whose train step (as ``dora-jax check`` compiles it) is one update of ``rows`` rows of ``seq``
    tokens: prompts of ``seq // 4``, responses filling the rest, one length bucket."""
    from dora_jax.config import Config, DoraConfig, ModelConfig, RolloutConfig, TrainConfig

    prompt = seq // 4
    cfg = Config(model=ModelConfig(**model, max_seq_len=seq),
                 train=TrainConfig(group_size=4, length_buckets=(seq,), max_response_tokens=seq - prompt, **train),
                 rollout=RolloutConfig(max_prompt_len=prompt, max_new_tokens=seq - prompt),
                 dora=DoraConfig(mode="sync", train_batch=rows, rollout_batch=rows))
    cfg.validate()
    return cfg


def _temp_bytes(cfg) -> int | None:
    """XLA's temporary bytes per device for one update of ``cfg`` (compiled ahead of time, not run)."""
    from dora_jax.check import trainer_memory
    from dora_jax.sharding import create_mesh

    return trainer_memory(cfg, create_mesh(cfg.mesh, jax.devices()[:1]), do_compile=True).temp


def _bf16_matmul_rate() -> float:
    """Measured bf16 matmul FLOP/s of an 8192^3 product (the device's practical peak)."""
    import jax.numpy as jnp

    from benchmarks.timing import best_of

    n = 8192
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
    return 2 * n**3 / best_of(lambda: f(a, a), seconds=1.0)


def bench_train_accel(lengths: tuple[int, ...] | None = None, tokens_per_step: int = 131072, repeats: int = 3,
                      seed: int = 0) -> dict[str, Any]:
    """``bench train --preset accel``: training at long sequence lengths with the long-sequence settings
    (``train.remat: full``, blockwise attention, chunked log-probs; float32 master weights, bf16 compute).

    On an accelerator: a Qwen2.5-1.5B-shaped model with random weights at 2k, 8k and 32k tokens per row,
    ``tokens_per_step`` tokens per update (rows = tokens_per_step / T, at least 4), each length's train step
    timed (best of ``repeats`` after compiling): tokens/s and MFU (against the device's dense bf16 peak where
    known, else the measured bf16 matmul rate), and its compiled temporary bytes. The log-prob chunk covers
    8192 positions of the update's rows (rows x chunk = 8192), so a chunk's logits are the same size at every
    length.

    On the CPU: the same memory analysis (compiled, not run) on a tiny model at 1k-8k tokens, 4 rows, chunks
    of 256 positions, for the long-sequence settings and for the plain ones (materialized attention scores,
    no remat, the whole [rows, T, V] logits): with Qwen's 152k vocabulary (where the logits dominate) and with
    a 512-token one (where attention does). No timing: MFU is an accelerator figure.

    Returns:
      ``temp_bytes_by_length`` (T -> bytes per device), ``mfu`` (T -> fraction, accelerator only, else None),
      ``tokens_s`` likewise, the growth from the shortest to the longest length, the plain settings' bytes
      and the small vocabulary's (CPU), the bytes [rows, T, V] float32 logits would take, the model and
      ``machine``.
    """
    import numpy as np

    from benchmarks.record import device
    from benchmarks.timing import time_calls

    on_cpu = jax.default_backend() == "cpu"
    model = CPU_MODEL if on_cpu else ACCEL_MODEL
    lengths = tuple(lengths or (CPU_LENGTHS if on_cpu else ACCEL_LENGTHS))
    rows_of = {t: 4 if on_cpu else max(4, tokens_per_step // t) for t in lengths}
    out: dict[str, Any] = {"preset": "accel", "model": model, "lengths": list(lengths),
                           "rows_by_length": {t: rows_of[t] for t in lengths}, "settings": LONG_SETTINGS,
                           "logprob_chunk_by_length": {},
                           "logits_bytes_by_length": {t: rows_of[t] * t * model["vocab_size"] * 4 for t in lengths}}
    if on_cpu:
        out["plain_settings"] = PLAIN_SETTINGS
        out["scores_bytes_by_length"] = {t: 4 * model["num_heads"] * t * t * 4 for t in lengths}
    chunk_rows = 1024 if on_cpu else 8192
    for t in lengths:
        chunk = max(1, chunk_rows // rows_of[t])
        out["logprob_chunk_by_length"][t] = chunk if chunk < t else 0
    first, last = lengths[0], lengths[-1]

    def series(vocab: int, settings: dict) -> dict[int, int]:
        """Compiled temporary bytes at every length (the plain settings name their own chunk: none)."""
        m = dict(model, vocab_size=vocab)
        chunk = out["logprob_chunk_by_length"]
        return {t: _temp_bytes(_length_config(m, t, rows_of[t], {"logprob_chunk": chunk[t], **settings}))
                for t in lengths}

    out["temp_bytes_by_length"] = temp = series(model["vocab_size"], LONG_SETTINGS)
    out[f"temp_growth_{last}_over_{first}"] = temp[last] / temp[first]
    if on_cpu:
        out["plain_temp_bytes_by_length"] = plain = series(model["vocab_size"], PLAIN_SETTINGS)
        out[f"plain_temp_growth_{last}_over_{first}"] = plain[last] / plain[first]
        small = {"vocab_size": 512, "temp_bytes_by_length": series(512, LONG_SETTINGS),
                 "plain_temp_bytes_by_length": series(512, PLAIN_SETTINGS)}
        for k in ("temp", "plain_temp"):
            b = small[f"{k}_bytes_by_length"]
            small[f"{k}_growth_{last}_over_{first}"] = b[last] / b[first]
        out["small_vocab"] = small
        out["mfu"] = None
        out["tokens_s"] = None
        out["note"] = "CPU: memory analysis only (compiled, not run); tokens/s and MFU are measured on an accelerator"
    else:
        kind = device()
        peak = next((v for k, v in BF16_PEAK.items() if k in kind), None)
        measured = _bf16_matmul_rate()
        out.update(bf16_peak_flop_s=peak, measured_bf16_matmul_flop_s=measured,
                   mfu_denominator="bf16 data-sheet peak" if peak else "measured bf16 matmul rate",
                   mfu={}, tokens_s={}, step_s={})
        rng = np.random.default_rng(seed)
        for t in lengths:
            rows, prompt = rows_of[t], t // 4
            cfg = _length_config(model, t, rows, dict(LONG_SETTINGS, logprob_chunk=out["logprob_chunk_by_length"][t]))
            samples = synthetic_samples(rng, rows, prompt, t - prompt, model["vocab_size"])
            _, trainer, state, batch = bench_trainer(cfg, samples, t, t - prompt, 0)

            def step():
                nonlocal state
                state, metrics = trainer.train_step(state, batch)
                return metrics

            times = time_calls(step, repeats=repeats + 1, warmup=0)  # the first call compiles
            step_s = min(times[1:])
            flops = train_flops(cfg.model, rows * t, t, lora=False)
            out["step_s"][t] = step_s
            out["tokens_s"][t] = rows * t / step_s
            out["mfu"][t] = flops / step_s / (peak or measured)
            del trainer, state, batch
    out["machine"] = machine()
    return out


# ``bench_packing``'s workloads: each draws a batch's token counts (prompt + response) per sample.
PACKING_WORKLOADS = {
    # ``bench modes``: the longtail task at 256 tokens, groups of 4 that share a prompt and its budget (every
    # response runs to its budget), 16 samples an update, one update an iteration, the bench's length buckets.
    "longtail_256": dict(max_len=256, prompt=16, per_group=True, samples=16, minibatches=1,
                         buckets=(64, 128, 192, 256, 320)),
    # Reasoning rollouts of the 32k preset's shape: the same long-tailed law at 32256 response tokens, drawn per
    # sample (a group's responses differ in length), 512-token prompts, 64 samples an iteration in 4 updates.
    "reasoning_32k": dict(max_len=32256, prompt=512, per_group=False, samples=64, minibatches=4,
                          buckets=(2048, 4096, 8192, 16384, 32768)),
}


def _workload_lengths(spec: dict, iteration: int, seed: int) -> list[int]:
    from dora_jax.tasks.synthetic import LongTailTask

    task = LongTailTask(seed=seed, eval_size=0, max_len=spec["max_len"])
    n = spec["samples"]
    cap = spec["max_len"]
    if spec["per_group"]:
        return [spec["prompt"] + task.train_item(iteration * n // 4 + i // 4).budget(i % 4, cap) for i in range(n)]
    return [spec["prompt"] + task.train_item(iteration * n + i).budget(0, cap) for i in range(n)]


def bench_packing(iterations: int = 200, seed: int = 0, micro_batches: int = 1, timed: bool = True,
                  repeats: int = 3) -> dict[str, Any]:
    """``train.packing``: rows trained and padding, one sample per row against packed rows, on long-tailed
    batches (:data:`PACKING_WORKLOADS`); and, with ``timed``, one iteration's train step on the CPU with the tiny
    Llama on a ``longtail_256`` batch, both ways.

    The counts come from the trainer's own planning (:func:`dora_jax.trainer.packing.iteration_plan`, what
    ``Trainer.train_step`` runs): per update, the rows the forward runs on and the fraction of their token slots
    that is padding (padded slots / all slots), averaged over ``iterations`` drawn batches. An update's groups
    are consecutive in the batch (the split a minibatch shuffle makes, in distribution). One data-parallel
    device (with several, each packs its own share alike) and ``micro_batches`` per update.

    Returns:
      Per workload: ``rows_per_update`` and ``padding_frac`` (mean over updates) for ``none`` and ``pack``,
      ``slots_ratio`` (packed token slots / unpacked: what the forward and backward's per-token work scales
      with; attention's scales with rows at a fixed length), the row-length buckets met; with ``timed``, the
      step's seconds both ways (best of ``repeats`` after compiling) and ``machine``.
    """
    import numpy as np

    from dora_jax.trainer.batch import bucket_length, bucket_rows
    from dora_jax.trainer.packing import iteration_plan

    out: dict[str, Any] = {"iterations": iterations, "seed": seed, "micro_batches": micro_batches, "workloads": {}}
    for name, spec in PACKING_WORKLOADS.items():
        per = spec["samples"] // spec["minibatches"]
        rows = {"none": [], "pack": []}
        padding = {"none": [], "pack": []}
        slots = {"none": 0, "pack": 0}
        lengths_met: dict[int, int] = {}
        for it in range(iterations):
            lengths = np.asarray(_workload_lengths(spec, it, seed), np.int32)
            t = bucket_length(int(lengths.max()), spec["buckets"])
            lengths_met[t] = lengths_met.get(t, 0) + 1
            b = bucket_rows(per, micro_batches)
            updates = [np.pad(lengths[j * per:(j + 1) * per], (0, b - per)) for j in range(spec["minibatches"])]
            packs = iteration_plan(updates, t, 1, b // micro_batches, micro_batches)
            for n, pk in zip(updates, packs):
                real = int(n.sum())
                for kind, r in (("none", b), ("pack", pk.source.shape[0] * pk.source.shape[1])):
                    rows[kind].append(r)
                    padding[kind].append(1 - real / (r * t))
                    slots[kind] += r * t
        out["workloads"][name] = {
            "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()},
            "row_lengths_met": {str(k): v for k, v in sorted(lengths_met.items())},
            **{f"rows_per_update_{k}": float(np.mean(v)) for k, v in rows.items()},
            **{f"padding_frac_{k}": float(np.mean(v)) for k, v in padding.items()},
            "slots_ratio": slots["pack"] / slots["none"],
        }
    if timed:
        out["timed"] = _time_packing(seed, repeats)
    out["machine"] = machine()
    return out


def _time_packing(seed: int, repeats: int) -> dict[str, Any]:
    """One iteration's train step (tiny Llama, one CPU device), unpacked and packed, on the first
    ``longtail_256`` batch that meets the tail (a sample over half the task's length): best and median of
    ``repeats`` calls each, alternating."""
    import numpy as np

    from dora_jax.config import MeshConfig, load_config
    from dora_jax.trainer import Sample

    spec = PACKING_WORKLOADS["longtail_256"]
    lengths = next(n for n in (_workload_lengths(spec, i, seed) for i in range(1000))
                   if max(n) - spec["prompt"] > spec["max_len"] // 2)
    rng = np.random.default_rng(seed)
    cfg = load_config("tiny_llama")
    one_device = dataclasses.replace(MeshConfig(), logical_axis_rules=cfg.mesh.logical_axis_rules)
    cfg = dataclasses.replace(cfg, mesh=one_device)
    samples = [Sample(i, i // 4, 0, rng.integers(1, 256, spec["prompt"]).tolist(),
                      rng.integers(1, 256, n - spec["prompt"]).tolist(),
                      (-rng.uniform(0.5, 5.0, n - spec["prompt"])).tolist(), float(rng.normal()))
               for i, n in enumerate(lengths)]
    seq = next(b for b in spec["buckets"] if b >= max(lengths))
    out: dict[str, Any] = {"lengths": lengths, "row_length": seq}
    runs = {}
    for kind in ("none", "pack"):
        _, trainer, state, batch = bench_trainer(cfg, samples, seq, seq - spec["prompt"], 0, packing=kind,
                                                 attention_impl="blockwise", attention_block=64)
        runs[kind] = {"trainer": trainer, "state": state, "batch": batch}

    def step(kind):
        r = runs[kind]
        r["state"], r["metrics"] = r["trainer"].train_step(r["state"], r["batch"])
        return r["metrics"]

    for kind in runs:  # compile
        jax.block_until_ready(step(kind))
    # The two ways alternate call by call, so a load that comes and goes on a shared machine meets both alike.
    times: dict[str, list[float]] = {kind: [] for kind in runs}
    for _ in range(repeats):
        for kind in runs:
            times[kind].extend(time_calls(lambda: step(kind), repeats=1, warmup=0))
    for kind, r in runs.items():
        out[kind] = {"step_s": min(times[kind]), "median_step_s": sorted(times[kind])[len(times[kind]) // 2],
                     "rows": float(r["metrics"]["rows"]), "padding_frac": float(r["metrics"]["padding_frac"])}
    out["speedup"] = out["none"]["step_s"] / out["pack"]["step_s"]
    out["median_speedup"] = out["none"]["median_step_s"] / out["pack"]["median_step_s"]
    return out


if __name__ == "__main__":
    import argparse
    import json
    import sys

    from benchmarks.record import command_line, stamp, write_json

    parser = argparse.ArgumentParser(description="train.packing: rows and padding, packed against unpacked")
    parser.add_argument("--iterations", type=int, default=200)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--no-timing", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps after the compiling one (best taken)")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    result = stamp(bench_packing(args.iterations, micro_batches=args.micro_batches, timed=not args.no_timing,
                                 repeats=args.repeats),
                   command_line(".venv/bin/python -m benchmarks.train", sys.argv[1:]))
    print(json.dumps(result, indent=1))
    if args.json:
        write_json(result, args.json)
