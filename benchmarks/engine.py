"""``dora-jax bench engine``: the rollout engine against transformers, the roofline and its own forms.

Also the pieces the experiments in ``benchmarks/experiments`` share with it: the benchmark's prompts, one fixed
batch through a ``RolloutDriver``, two forms of it side by side, and transformers' ``generate`` timed the same
way.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from benchmarks.rates import measure_machine, measure_matmul, measure_matmul_chain
from benchmarks.record import machine
from benchmarks.timing import alternated, best_alternated, timed


def _lengths(n: int, rng, p50: int, tail: int, max_len: int):
    """Long-tailed output lengths: most near p50, a few ~tail; p99/p50 >= 8 for tail >= 8 * p50."""
    import numpy as np

    base = rng.integers(max(1, p50 // 2), p50 * 3 // 2 + 1, n)
    heavy = rng.random(n) < 0.08
    return np.minimum(np.where(heavy, rng.integers(tail // 2, tail + 1, n), base), max_len).tolist()


def hf_generate_run(prompts: list[list[int]], new_tokens: int, dtype: str, out: dict[str, Any], model: Any = None):
    """A callable that times transformers ``generate`` on SmolLM2's GGUF and returns tokens/s.

    ``prompts`` run as one left-padded batch, exactly ``new_tokens`` tokens each sampled at temperature 1
    without top-k, with transformers' own KV cache. On a GPU backend it runs on the GPU (torch's CUDA build)
    with TF32 matmuls allowed, as XLA's default float32 dot precision does there.

    Args:
      prompts: token ids, one list per row.
      new_tokens: tokens each row generates.
      dtype: torch dtype name of the model (the engine's compute dtype).
      out: receives ``torch_threads`` and ``hf_device`` (and ``hf_allow_tf32``).
      model: SmolLM2 as a transformers model already loaded (default: loaded here from the GGUF).

    Returns:
      The callable, or None when torch or transformers is not installed.
    """
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from dora_jax.models.gguf import smollm2_gguf_path

    hf = model
    if hf is None:
        path = smollm2_gguf_path()
        hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                               gguf_file=os.path.basename(path)).eval()
    width = max(len(p) for p in prompts)
    dev = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    hf = hf.to(device=dev, dtype=getattr(torch, dtype))
    inp = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    torch.set_num_threads(os.cpu_count() or 1)  # every core, as XLA uses
    out["torch_threads"], out["hf_device"] = torch.get_num_threads(), dev
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        out["hf_allow_tf32"] = True
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    with torch.inference_mode():  # warm-up
        hf.generate(inp[:2], attention_mask=mask[:2], max_new_tokens=4, do_sample=True, pad_token_id=0)
        sync()

    def generate():
        seqs = hf.generate(inp, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                           do_sample=True, temperature=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
        sync()
        return seqs

    def run() -> float:
        with torch.inference_mode():
            seqs, seconds = timed(generate)
        if tuple(seqs.shape) != (len(prompts), width + new_tokens):  # the rate counts exactly new_tokens a row
            raise RuntimeError(f"transformers generate returned {tuple(seqs.shape)} tokens, expected "
                               f"{(len(prompts), width + new_tokens)} ({new_tokens} new after {width})")
        return len(prompts) * new_tokens / seconds
    return run


def bench_prompts(tok, n: int, rng) -> list[list[int]]:
    """The engine benchmark's prompts: chat-templated "What is a + b?" questions.

    Args:
      tok: the model's tokenizer (with its chat template).
      n: prompts.
      rng: the numpy generator a and b are drawn from (the benchmark's is ``np.random.default_rng(0)``).

    Returns:
      Each prompt's token ids.
    """
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}]))
            for a, b in rng.integers(10, 1000, (n, 2))]


def run_fixed_batch(engine, params, prompts, new_tokens: int = 128, shared_prefix=(), overlap=None, seed: int = 0,
                    decode_steps=None):
    """Every prompt through a fresh ``RolloutDriver`` for exactly ``new_tokens`` sampled tokens (temperature
    1, no stop), timed until nothing dispatched is left running.

    Args:
      engine: the ``Engine``.
      params: the policy's parameters (version 0).
      prompts: token ids, one list per request.
      new_tokens: tokens each request generates.
      shared_prefix: tokens every prompt starts with, prefilled once (``RolloutDriver(shared_prefix=...)``).
      overlap: ``RolloutDriver(overlap=...)``; None: the engine's default.
      seed: the sampling seed.
      decode_steps: ``RolloutDriver(decode_steps=...)``; None: the engine's setting (``rollout.decode_steps``).

    Returns:
      ``(tokens/s, driver, trajectories by sample id)``.
    """
    from dora_jax.rollout.driver import RolloutDriver
    from dora_jax.rollout.engine import RequestSampling
    from dora_jax.rollout.samples import Request

    d = RolloutDriver(engine, overlap=overlap, shared_prefix=shared_prefix, decode_steps=decode_steps)
    d.add_version(0, params)
    sampling = RequestSampling(temperature=1.0, seed=seed)

    def rollout():
        trajs = d.run([Request(i, tuple(p), max_new_tokens=new_tokens, sampling=sampling)
                       for i, p in enumerate(prompts)])
        d.block_until_ready()
        return trajs

    trajs, seconds = timed(rollout)
    return sum(len(t.tokens) for t in trajs) / seconds, d, sorted(trajs, key=lambda t: t.sample_id)


def _per_dispatch(stats) -> dict[str, float]:
    """A driver's device decode steps per host dispatch: the mean over its run and the median dispatch."""
    import numpy as np

    runs = [n for n, count in stats.dispatch_steps.items() for _ in range(count)]
    steady = stats.steady_decode_steps_per_dispatch
    return {"decode_steps_per_dispatch": stats.decode_steps_per_dispatch,
            "decode_steps_per_dispatch_median": float(np.median(runs)) if runs else 0.0,
            "decode_steps_per_dispatch_steady": steady}


def compare_fixed_batches(runs: dict[str, Any], rounds: int) -> None:
    """Two forms of the engine side by side, printed round by round.

    Each is called once (compiling), then the two alternate ``rounds`` times; every round prints both rates,
    the second / the first, and how many trajectories have the same tokens in both.

    Args:
      runs: two names -> callables returning ``(tokens/s, trajectories by sample id)``, as
        :func:`run_fixed_batch` does.
      rounds: alternated rounds.
    """
    (name_a, run_a), (name_b, run_b) = runs.items()
    run_a(), run_b()
    for _ in range(rounds):
        (a, ta), (b, tb) = run_a(), run_b()
        same = sum(x.tokens == y.tokens for x, y in zip(ta, tb))
        print(f"fixed batch: {name_a} {a:.1f}, {name_b} {b:.1f} tokens/s, {name_b} / {name_a} {b / a:.2f}x, "
              f"same tokens in {same} of {len(ta)} trajectories", flush=True)


def bench_engine(config: str = "smollm2_135m", batch: int = 32, new_tokens: int = 128, tail_requests: int = 64,
                 tail_slots: int = 16, group_size: int = 4, seed: int = 0, with_hf: bool = True,
                 overrides: tuple[str, ...] = (), rounds: int = 3, decode_summary: bool = False,
                 all_parts: bool = True) -> dict[str, Any]:
    """The engine benchmark, side by side in one run: throughput at a fixed batch vs transformers (the two
    alternated ``rounds`` times: ``engine_tok_s`` and ``hf_tok_s`` are each one's best, every run is in
    ``fixed_batch_runs``, ``engine_vs_hf_median`` is the ratio of the medians) and vs the roofline;
    continuous batching vs a static batch on a long-tailed workload (alternated the same way,
    ``long_tail_runs``); on the same lengths in GRPO groups of ``group_size`` samples per prompt, one prefill
    per distinct prompt vs one per sample; and the fixed batch and the long tail's continuous run with and
    without host/device overlap (``RolloutDriver(overlap=...)``); the long tail with and without the
    shared prefix; and the fixed batch and the long tail's continuous run with ``rollout.decode_steps`` decode
    steps per dispatched program against one (``decode_steps_per_dispatch``: the configured runs' mean device
    steps per host dispatch, ``..._median`` the typical dispatch).

    Every run prefills the chat template's head once per driver and each prompt after it, as a training run
    does with ``rollout.shared_prefix`` (the default; ``rollout.shared_prefix=false`` turns it off here too);
    the roofline counts that work: the head once, each prompt's tokens after it.

    Args:
      config: a shipped preset or YAML file; one without a tokenizer runs random prompts sharing a 16-token
        head and no transformers side.
      batch: sequences of the fixed batch.
      new_tokens: tokens each sequence of the fixed batch generates (the long tail's cap).
      tail_requests: requests of the long-tailed workload.
      tail_slots: decode slots of the long-tail, group and shared-prefix parts.
      group_size: samples per prompt in the GRPO-groups part.
      seed: prompts, lengths and sampling.
      with_hf: time transformers' ``generate`` beside the fixed batch (when installed).
      overrides: ``key=value`` config overrides.
      rounds: alternated runs of the fixed batch and of the long tail.
      decode_summary: also ``decode_summary``, the fixed batch run once more with its decode steps timed apart
        from prefill (:func:`measure_decode`) and their bandwidth roofline (:func:`decode_roofline_fraction`).
      all_parts: False stops after the long tail (parts 1 and 2).

    Returns:
      The JSON-able figures of every part (``engine_tok_s``, ``hf_tok_s``, ``roofline_tok_s``,
      ``continuous_vs_static``, ...) and ``machine``.
    """
    import numpy as np
    from flax import nnx

    from dora_jax.config import load_config
    from dora_jax.models.decoder import DecodeSettings, resolve_attention_impl
    from dora_jax.models.weights import load_model
    from dora_jax.rollout.driver import RolloutDriver
    from dora_jax.rollout.engine import Engine, RequestSampling
    from dora_jax.rollout.samples import Request
    from dora_jax.tokenizer import chat_template_head
    from tqdm.auto import tqdm

    cfg = load_config(config, overrides)
    model, tok = load_model(cfg.model, progress=False)
    params = nnx.state(model)
    rng = np.random.default_rng(seed)
    if tok is not None:
        prompts = bench_prompts(tok, max(batch, tail_requests), rng)
    else:  # a random-weight config without a tokenizer: random prompts of 32-48 tokens whose first 16 are the
        # same (standing in for a chat template's head), no transformers side
        common = rng.integers(3, cfg.model.vocab_size, 16).tolist()
        prompts = [common + rng.integers(3, cfg.model.vocab_size, int(rng.integers(16, 33))).tolist()
                   for _ in range(max(batch, tail_requests))]
        with_hf = False
    # The head every prompt starts with, prefilled once per driver (rollout.shared_prefix).
    head: tuple[int, ...] = ()
    if cfg.rollout.shared_prefix:
        head = tuple(chat_template_head(tok)) if tok is not None else tuple(common)
    plen = max(len(p) for p in prompts)
    target = 1 << (plen + new_tokens - 1).bit_length()
    sampling = RequestSampling(temperature=1.0, seed=seed)
    # The engine as a run of this config builds it: the rollout section's dtype and decode settings.
    serving = dict(dtype=cfg.rollout.dtype, settings=DecodeSettings.of(cfg.rollout))
    eng = Engine(model, max_concurrent_decodes=batch, max_prefill_length=plen, max_target_length=target, **serving)
    c = eng.cfg  # the architecture in the engine's dtype
    out: dict[str, Any] = {"config": config, "overrides": list(overrides), "batch": batch, "new_tokens": new_tokens,
                           "prompt_tokens": plen, "attention_impl": resolve_attention_impl(eng.settings),
                           "dtype": eng.dtype, "shared_prefix_tokens": len(head)}

    bar = tqdm(total=6, desc="bench engine", unit="part")  # six parts, minutes each on a CPU
    # 1. Fixed batch: `batch` sequences, `new_tokens` each (no early stop), sampling.

    def fixed_run(overlap=None, decode_steps=None):
        rate, d, _ = run_fixed_batch(eng, params, prompts[:batch], new_tokens, head, overlap, seed, decode_steps)
        return rate, d

    # transformers `generate` at the same batch and sampling, timed alternately with the engine's run.
    hf_run = hf_generate_run(prompts[:batch], new_tokens, c.compute_dtype, out) if with_hf else None
    first = fixed_run()[1]  # compiles
    out["overlap"], out["decode_steps"] = first.overlap, first.decode_steps
    out.update(_per_dispatch(first.stats))
    runs = {"engine_tok_s": lambda: fixed_run()[0]}
    if hf_run is not None:
        runs["hf_tok_s"] = hf_run
    seen = alternated(runs, rounds)
    out.update({k: max(v) for k, v in seen.items()}, fixed_batch_runs=seen)
    if hf_run is not None:
        out["engine_vs_hf"] = out["engine_tok_s"] / out["hf_tok_s"]
        out["engine_vs_hf_median"] = float(np.median(seen["engine_tok_s"]) / np.median(seen["hf_tok_s"]))
    elif with_hf:
        out["hf_tok_s"] = None

    # Roofline of the whole measured run (prefill included: the timed run does it), from the matmul rate and
    # read bandwidth measured now. Prefill of each prompt: 2 FLOPs per layer param per prompt token plus the
    # head on its last token, weights read once. Each decode step: 2 FLOPs per param per row (the tied head
    # counted once) plus attention over the row's context; weights read once plus every row's cache.
    m = measure_machine()
    m["matmul_flop_s_at_batch"] = measure_matmul(batch, cfg.model.hidden_size, 2 * cfg.model.intermediate_size)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    n_head = c.vocab_size * c.hidden_size
    n_layers = n_params - n_head * (1 if c.tie_embeddings else 2) - c.hidden_size
    weight_bytes = n_params * jax.numpy.dtype(c.compute_dtype).itemsize  # as the engine holds them
    cache_item = jax.numpy.dtype(c.compute_dtype).itemsize
    attn = 4 * c.num_layers * c.num_heads * c.head_dim  # FLOPs per (query, key) pair
    def prefill_cost(start, end, head_rows=1):  # tokens start..end - 1 of a prompt, attending to 0..end - 1
        flops = (2 * n_layers * (end - start) + attn * (end * (end + 1) - start * (start + 1)) / 2
                 + 2 * n_head * head_rows)
        return max(flops / m["matmul_flop_s"], weight_bytes / m["read_bytes_s"])

    prefill_s = sum(prefill_cost(len(head), len(p)) for p in prompts[:batch]) + (prefill_cost(0, len(head), 0)
                                                                                  if head else 0.0)
    decode_s = 0.0
    for i in range(1, new_tokens):  # the first token of each row comes from prefill
        ctx = sum(len(p) + i for p in prompts[:batch])
        kv_bytes = 2 * c.num_layers * c.num_kv_heads * c.head_dim * cache_item * ctx
        decode_s += max((2 * n_params * batch + attn * ctx) / m["matmul_flop_s"],
                        (weight_bytes + kv_bytes) / m["read_bytes_s"])
    step_s = decode_s / (new_tokens - 1)
    out.update(m, roofline_tok_s=batch * new_tokens / (prefill_s + decode_s),
               roofline_prefill_s=prefill_s, roofline_decode_step_ms=1e3 * step_s,
               decode_only_roofline_tok_s=batch / step_s)
    out["roofline_fraction"] = out["engine_tok_s"] / out["roofline_tok_s"]
    if decode_summary:
        prepared = eng.prepare_params(params)
        s = measure_decode(eng, prepared, [Request(i, tuple(p), max_new_tokens=new_tokens, sampling=sampling)
                                           for i, p in enumerate(prompts[:batch])], prefix=head)
        bw, source = memory_bandwidth()
        weight_bytes, token_bytes = sum(x.nbytes for x in jax.tree.leaves(prepared.tree)), kv_token_bytes(c)
        _roofline(s, weight_bytes, token_bytes, bw)
        out["decode_summary"] = dict(s, weight_bytes=weight_bytes, kv_token_bytes=token_bytes,
                                     bandwidth_bytes_s=bw, bandwidth_source=source)

    # The ceiling of both ratios above: a decode step built from these products (in the faster of the two
    # weight layouts) cannot beat its weight matmuls, so with every other part of the step free the engine
    # would reach `matmul_only_tok_s`. Its ratio to transformers and to the decode roofline bounds
    # `engine_vs_hf` and `roofline_fraction` (prefill only lowers them further).
    out.update(measure_matmul_chain(c, batch, torch_device=out.get("hf_device") if out.get("hf_tok_s") else None))
    out["engine_vs_matmul_only"] = out["engine_tok_s"] / out["matmul_only_tok_s"]
    out["matmul_only_vs_decode_roofline"] = out["matmul_only_tok_s"] / out["decode_only_roofline_tok_s"]
    if out.get("hf_tok_s"):
        out["matmul_only_vs_hf"] = out["matmul_only_tok_s"] / out["hf_tok_s"]

    bar.update()
    bar.set_postfix_str("long tail")
    # 2. Long tail: continuous batching vs static batches that wait for their longest member; alternated,
    # best of `rounds` each.
    lengths = _lengths(tail_requests, rng, p50=8, tail=96, max_len=new_tokens)
    out["tail_lengths"] = {"p50": float(np.percentile(lengths, 50)), "p99": float(np.percentile(lengths, 99)),
                           "max": int(max(lengths)), "total": int(sum(lengths))}
    reqs = [Request(i, tuple(prompts[i]), max_new_tokens=int(n), sampling=sampling) for i, n in enumerate(lengths)]
    eng2 = eng if tail_slots == batch else Engine(model, max_concurrent_decodes=tail_slots, max_prefill_length=plen,
                                                  max_target_length=target, **serving)  # same slots: its programs

    def continuous(overlap=None, prefix=head, decode_steps=None, driver=None):
        d = RolloutDriver(eng2, overlap=overlap, shared_prefix=prefix, decode_steps=decode_steps)
        d.add_version(0, params)
        _, seconds = timed(lambda: (d.run(reqs), d.block_until_ready()))
        if driver is not None:
            driver.append(d)
        return sum(lengths) / seconds, d.stats.slot_utilization

    def static(prefix=head):
        d = RolloutDriver(eng2, compact=False, shared_prefix=prefix)
        d.add_version(0, params)
        _, seconds = timed(lambda: [d.run(reqs[i:i + tail_slots]) for i in range(0, len(reqs), tail_slots)])
        return sum(lengths) / seconds, d.stats.slot_utilization

    continuous(), static()  # compile every capacity both use
    util: dict[str, float] = {}  # the same schedule every run: the utilization does not vary

    def recording(name, fn):
        def run():
            rate, util[name] = fn()
            return rate
        return run

    seen = alternated({"continuous_tok_s": recording("continuous", continuous),
                       "static_tok_s": recording("static", static)}, rounds)
    out.update({k: max(v) for k, v in seen.items()}, long_tail_runs=seen, slot_utilization=util)
    out["continuous_vs_static"] = out["continuous_tok_s"] / out["static_tok_s"]
    if not all_parts:
        bar.update(4)
        bar.close()
        out["machine"] = machine()
        return out

    bar.update()
    bar.set_postfix_str("GRPO groups")
    # 3. GRPO groups: the same long-tailed lengths, but every `group_size` consecutive samples share a prompt.
    # Continuous batching with each distinct prompt prefilled once per admission vs every sample prefilled
    # on its own (one prompt per prefill program, as a JetStream engine does).
    grouped = [Request(i, tuple(prompts[i // group_size]), max_new_tokens=int(n), sampling=sampling)
               for i, n in enumerate(lengths)]

    def groups(batch_prefill):
        d = RolloutDriver(eng2, batch_prefill=batch_prefill, shared_prefix=head)
        d.add_version(0, params)
        return sum(lengths) / timed(lambda: d.run(grouped))[1]

    groups(True), groups(False)  # compile
    out["group_size"] = group_size
    out["group_prefill_tok_s"], out["single_prefill_tok_s"] = groups(True), groups(False)
    out["group_vs_single_prefill"] = out["group_prefill_tok_s"] / out["single_prefill_tok_s"]

    bar.update()
    bar.set_postfix_str("overlap")
    # 4. Host/device overlap: the fixed batch of part 1 and the long tail's continuous run (admissions while
    # a step is in flight) with step t + 1 dispatched before step t is read back, against reading each step
    # before dispatching the next; alternated, best of two each (of five when a run is shorter than two
    # seconds, as on a small model, where one run is noisy).
    continuous(True)  # compile the capacities its timing reaches
    for name, fn, secs in (("", lambda o: fixed_run(o)[0], batch * new_tokens / out["engine_tok_s"]),
                           ("tail_", lambda o: continuous(o)[0], sum(lengths) / out["continuous_tok_s"])):
        best = best_alternated({f"no_overlap_{name}tok_s": lambda: fn(False),
                                f"overlap_{name}tok_s": lambda: fn(True)}, rounds=2 if secs > 2 else 5)
        out.update(best)
        out[f"overlap_{name}vs_none"] = best[f"overlap_{name}tok_s"] / best[f"no_overlap_{name}tok_s"]

    bar.update()
    bar.set_postfix_str("shared prefix")
    # 5. The shared prefix: the long tail's continuous and static runs with the template head prefilled once
    # (as above) and with every prompt prefilled whole; alternated, best of two each.
    if head:
        continuous(prefix=()), static(prefix=())  # compile the whole-prompt buckets
        out.update(best_alternated({"no_prefix_continuous_tok_s": lambda: continuous(prefix=())[0],
                                    "no_prefix_static_tok_s": lambda: static(prefix=())[0],
                                    "prefix_continuous_tok_s": lambda: continuous(prefix=head)[0],
                                    "prefix_static_tok_s": lambda: static(prefix=head)[0]}, rounds=2))
        for name in ("prefix", "no_prefix"):
            out[f"{name}_continuous_vs_static"] = out[f"{name}_continuous_tok_s"] / out[f"{name}_static_tok_s"]
        out["prefix_vs_none_continuous"] = out["prefix_continuous_tok_s"] / out["no_prefix_continuous_tok_s"]

    bar.update()
    bar.set_postfix_str("decode steps")
    # 6. Several decode steps per dispatched program: the fixed batch and the long tail's continuous run with
    # the configured rollout.decode_steps against one step per program; alternated, best of `rounds` each.
    tail: list[Any] = []
    continuous(decode_steps=1), continuous(driver=tail)  # compile the capacities the long tail reaches
    out.update({f"tail_{k}": v for k, v in _per_dispatch(tail[-1].stats).items()})
    if out["decode_steps"] > 1:
        fixed_run(decode_steps=1)  # compile the one-step programs
        out.update(best_alternated({"one_step_tok_s": lambda: fixed_run(decode_steps=1)[0],
                                    "multi_step_tok_s": lambda: fixed_run()[0],
                                    "one_step_tail_tok_s": lambda: continuous(decode_steps=1)[0],
                                    "multi_step_tail_tok_s": lambda: continuous()[0]}, rounds))
        out["multi_step_vs_one"] = out["multi_step_tok_s"] / out["one_step_tok_s"]
        out["multi_step_tail_vs_one"] = out["multi_step_tail_tok_s"] / out["one_step_tail_tok_s"]
    bar.update()
    bar.close()
    out["machine"] = machine()
    return out


# Peak memory bandwidth (bytes/s) by device kind, from the vendors' data sheets. Matched as substrings of
# ``device_kind`` in order, so the more specific names (H100 PCIe, TPU v5 lite) come before the ones they contain.
PEAK_BANDWIDTH = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("A100 80GB", 2.0e12),
                  ("A100-SXM4-80GB", 2.0e12), ("TPU v5 lite", 8.19e11), ("TPU v5e", 8.19e11), ("TPU v5p", 2.76e12),
                  ("TPU v5", 2.76e12), ("TPU v6 lite", 1.64e12), ("TPU v6e", 1.64e12), ("TPU v4", 1.2e12))


def peak_bandwidth(kind: str) -> tuple[float, str] | None:
    """The data-sheet bandwidth of a device kind and the entry that matched it, or None for an unknown kind."""
    for name, bw in PEAK_BANDWIDTH:
        if name.lower() in kind.lower():
            return bw, name
    return None


def measure_copy_bandwidth(mib: int = 256, host: bool = True) -> float:
    """Bytes read plus written per second by a copy of a ``mib`` MiB float32 array, the best of five: decode's
    memory traffic is this kind of streaming. ``host``: numpy in host memory (XLA's CPU elementwise loop
    streams several times slower than a copy, which would flatter the roofline); else a jitted elementwise
    pass on the default device."""
    import numpy as np

    from benchmarks.timing import best_of

    if host:
        src = np.ones(mib * 2**18, np.float32)
        dst = np.empty_like(src)
        return 2 * src.nbytes / best_of(lambda: np.copyto(dst, src), repeats=5)
    x = jax.numpy.ones(mib * 2**18, jax.numpy.float32)
    f = jax.jit(lambda a: a * 1.5)
    return 2 * x.nbytes / best_of(lambda: f(x).block_until_ready(), repeats=5)


def memory_bandwidth(dev=None) -> tuple[float, str]:
    """The bandwidth the roofline divides by and where it came from: the data sheet for a known accelerator,
    else (a CPU, an unknown kind) measured now."""
    dev = dev or jax.devices()[0]
    cpu = dev.platform == "cpu"
    known = None if cpu else peak_bandwidth(str(dev.device_kind))
    if known is not None:
        return known[0], f"data sheet ({known[1]})"
    how = "numpy copy in host memory" if cpu else f"jitted elementwise pass on {dev.device_kind}"
    return measure_copy_bandwidth(host=cpu), f"measured ({how}, 256 MiB float32, bytes read + written)"


def kv_token_bytes(cfg) -> int:
    """KV cache bytes of one token: keys and values of every layer's KV heads, in the compute dtype."""
    import numpy as np

    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * np.dtype(cfg.compute_dtype).itemsize


def live_token_steps(prompt_lens, out_lens) -> int:
    """Tokens of live context read over every decode step of a run: a request of prompt ``p`` generating ``n``
    tokens takes its first from prefill, then ``n - 1`` steps reading ``p + 1 .. p + n - 1`` tokens."""
    return int(sum((n - 1) * p + n * (n - 1) // 2 for p, n in zip(prompt_lens, out_lens) if n > 0))


def decode_roofline_fraction(weight_bytes: float, live_tokens_per_step: float, token_kv_bytes: float,
                             bandwidth_bytes_s: float, step_s: float) -> float:
    """Roofline decode step time over measured step time: a step must read the weights once and every live
    token's keys and values at least once, so it cannot beat ``(weights + live KV) / bandwidth``.

    Args:
      weight_bytes: the prepared params' bytes (the engine's dtype and layout).
      live_tokens_per_step: mean live context tokens per decode step.
      token_kv_bytes: :func:`kv_token_bytes`.
      bandwidth_bytes_s: :func:`memory_bandwidth`.
      step_s: measured seconds per decode step.

    Returns:
      The fraction (1 = at the roofline).
    """
    return (weight_bytes + live_tokens_per_step * token_kv_bytes) / bandwidth_bytes_s / step_s


def measure_decode(eng, prepared, requests, warmup=None, prefix=()) -> dict[str, Any]:
    """One timed continuous-batching run of ``requests`` on fresh drivers, with its decode steps timed apart
    from prefill: the same prompts run once more at one token each (that token comes from prefill, so no
    decode step runs) and that time is taken off. ``warmup`` (default ``requests``) runs first, for the
    programs to compile.

    Returns:
      ``tokens_per_s`` of the whole run, ``decode_step_ms``, ``live_tokens_per_step``, the driver's
      ``decode_steps_per_dispatch`` (and the median dispatch's), ``slot_utilization`` and ``kv_bytes_ratio``
      (None where the driver does not report it), the counts behind them.
    """
    import dataclasses

    from dora_jax.rollout.driver import RolloutDriver

    def run(reqs):
        d = RolloutDriver(eng, shared_prefix=prefix)
        d.add_version(0, prepared)
        trajs, seconds = timed(lambda: (d.run(reqs), d.block_until_ready())[0])
        return d, trajs, seconds

    from dora_jax.compiles import compile_count

    firsts = [dataclasses.replace(r, max_new_tokens=1) for r in requests]
    run(warmup or requests), run(firsts)
    # The timed run counts its compiles and its attention's reads (the counting's host time taken off).
    before, eng.count_reads = compile_count(), True
    eng.reads.reset()
    d, trajs, seconds = run(requests)
    compiles, eng.count_reads = compile_count() - before, False
    seconds -= eng.reads.seconds
    host_s = d.stats.host_s - eng.reads.seconds
    prefill_s = run(firsts)[2]
    by_id = {r.sample_id: len(r.prompt_ids) for r in requests}
    tokens = [len(t.tokens) for t in trajs]
    steps = max(d.stats.steps, 1)
    decode_s = max(seconds - prefill_s, 1e-9)
    ratio = d.stats.kv_bytes_ratio
    return {"requests": len(requests), "tokens": sum(tokens), "seconds": seconds, "prefill_only_seconds": prefill_s,
            "tokens_per_s": sum(tokens) / seconds, "decode_steps": d.stats.steps,
            "decode_step_ms": 1e3 * decode_s / steps,
            "live_tokens_per_step": live_token_steps([by_id[t.sample_id] for t in trajs], tokens) / steps,
            **_per_dispatch(d.stats), "slot_utilization": d.stats.slot_utilization,
            "kv_bytes_ratio": None if ratio is None else float(ratio),
            "compiles_during_timing": compiles.compiles, "compile_cache_loads_during_timing": compiles.cache_loads,
            "kv_read_ratio": eng.reads.ratio, "attention_trips_per_step": eng.reads.trips_per_step,
            "attention_loop_trips_per_step": eng.reads.loop_trips_per_step,
            "host_ms_per_dispatch": 1e3 * host_s / max(d.stats.dispatches, 1),
            "dispatches": d.stats.dispatches}


def _roofline(summary: dict[str, Any], weight_bytes: int, token_bytes: int, bw: float) -> None:
    step_s = summary["decode_step_ms"] / 1e3
    summary["roofline_decode_step_ms"] = 1e3 * (weight_bytes + summary["live_tokens_per_step"] * token_bytes) / bw
    summary["roofline_fraction"] = decode_roofline_fraction(weight_bytes, summary["live_tokens_per_step"],
                                                            token_bytes, bw, step_s)


# ``bench engine --preset accel``: Qwen2.5-1.5B's shape (Hugging Face config.json of Qwen/Qwen2.5-1.5B-Instruct)
# with random weights, held in bf16 from the start (no float32 copy to cast from).
ACCEL_ENGINE_MODEL = dict(family="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                          num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1000000.0,
                          tie_embeddings=True, qkv_bias=True, param_dtype="bfloat16", compute_dtype="bfloat16")
# Its --quick form, the accelerator's schedule replayed on a CPU: Qwen's head layout, a two-layer body and a small
# vocabulary (neither changes the schedule's counts).
QUICK_ENGINE_MODEL = dict(ACCEL_ENGINE_MODEL, vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16)


def _top_level(preset: str, summary: dict[str, Any], bw: float, source: str, hf: float | None) -> dict[str, Any]:
    from benchmarks.record import today

    dev = jax.devices()[0]
    return {"preset": preset, "date": today(), "device": f"{dev.device_kind} ({dev.platform})",
            "device_kind": str(dev.device_kind), "platform": dev.platform,
            "tokens_per_s": summary["tokens_per_s"], "roofline_fraction": summary["roofline_fraction"],
            "kv_bytes_ratio": summary["kv_bytes_ratio"],
            # The steady state (every slot live), where there is one; the whole run's mean otherwise.
            "decode_steps_per_dispatch": summary.get("decode_steps_per_dispatch_steady")
            or summary["decode_steps_per_dispatch"],
            "slot_utilization": summary["slot_utilization"], "hf_tokens_per_s": hf,
            "bandwidth_bytes_s": bw, "bandwidth_source": source,
            **{k: summary.get(k) for k in ("compiles_during_timing", "kv_read_ratio", "host_ms_per_dispatch",
                                           "attention_trips_per_step", "kernels_per_layer",
                                           "kernels_per_layer_step", "warmup_s")}}


def warm_engine(eng, prepared, **plan_args) -> dict[str, Any]:
    """``warmup.warmup`` with the figures a benchmark records: ``warmup_s``, ``warmup_programs``,
    ``kernels_per_layer`` (kernels of one layer of the widest decode program, from its compiled HLO, its loops
    aside) and ``attention_loop_kernels`` (per loop inside the layer, the kernels of one trip and of one test of
    its condition: :func:`benchmarks.hlo.layer_kernels`)."""
    from benchmarks.hlo import layer_kernels
    from dora_jax.kernels.paged_attention import LIVE_LOOP_SCOPE
    from dora_jax.rollout.warmup import warmup, warmup_plan

    got = warmup(eng, prepared, progress=True, **plan_args)
    name, args = [x for x in warmup_plan(eng, prepared, **plan_args) if x[0] == "generate_steps"][-1]
    counts = layer_kernels(eng.compiled.lower(name, *args).compile().as_text(), eng.cfg.num_layers,
                           inner=LIVE_LOOP_SCOPE)
    return {"warmup_s": got["seconds"], "warmup_programs": got["programs"],
            "kernels_per_layer": None if counts is None else counts["per_layer"],
            "attention_loop_kernels": None if counts is None else counts["inner_loops"]}


def kernels_per_layer_step(summary: dict[str, Any]) -> float | None:
    """Kernels one layer launches per decode step: its own, and for each loop of its attention the kernels of a
    trip times the trips a step takes in it (``attention_loop_trips_per_step``), and of its condition, tested once
    a trip and once more to stop. None where the compiled loops are not the counted ones."""
    per_layer, loops = summary.get("kernels_per_layer"), summary.get("attention_loop_kernels")
    trips = summary.get("attention_loop_trips_per_step")
    if per_layer is None or loops is None or trips is None or len(loops) != len(trips):
        return None
    return per_layer + sum(body * n + cond * (n + 1) for (body, cond), n in zip(loops, trips))


def bench_engine_accel(quick: bool = False, batches: tuple[int, ...] | None = None, seed: int = 0,
                       attention_impl: str | None = None, prompt_tokens: int = 256, max_new_tokens: int = 4096,
                       median_new_tokens: int = 256, profile: str | None = None) -> dict[str, Any]:
    """``bench engine --preset accel``: the engine serving a Qwen2.5-1.5B-shaped model (random weights, bf16) at
    64 and 256 concurrent sequences, each batch of slots fed twice as many requests of 256 random prompt tokens
    with long-tailed output lengths (p50 256, up to 4,096), continuous batching as a training run's rollout
    does. The top-level figures are the largest batch's; every batch's are under ``batches``.

    ``quick``: the same requests, slots and lengths on a model of two small layers and a small vocabulary: a
    replay of the accelerator's schedule on a CPU, whose counts (decode steps, table widths, live tokens,
    compiles, attention reads, host time per dispatch) are the accelerator run's. ``attention_impl``: the decode
    attention over the page pool (``rollout.attention_impl``; default its default). ``profile``: a folder for a
    ``jax.profiler`` trace of steady decode dispatches at the largest batch (:func:`profile_decode`), whose top
    device ops go to ``top_ops.json`` there and under ``profile`` in the result.

    Every program is compiled before the clock starts (``warmup.warmup``; ``warmup_s``), and the timed run
    records ``compiles_during_timing``, ``kv_read_ratio``, ``attention_trips_per_step`` (per loop,
    ``attention_loop_trips_per_step``; with each loop's kernels, ``kernels_per_layer_step``) and
    ``host_ms_per_dispatch``.
    """
    import dataclasses

    import numpy as np

    from dora_jax.config import ModelConfig, RolloutConfig
    from dora_jax.models.build import init_model
    from dora_jax.models.decoder import DecodeSettings, resolve_attention_impl
    from dora_jax.rollout.engine import Engine, RequestSampling
    from dora_jax.rollout.samples import Request

    prompt, max_out, p50 = prompt_tokens, max_new_tokens, median_new_tokens  # smaller only in tests
    batches = batches or (64, 256)
    target = -(-(prompt + max_out) // 256) * 256  # whole 256-token blocks of cache
    model = init_model(ModelConfig(**(QUICK_ENGINE_MODEL if quick else ACCEL_ENGINE_MODEL), max_seq_len=target),
                       seed=seed)
    rollout = RolloutConfig() if attention_impl is None else RolloutConfig(attention_impl=attention_impl)
    settings = DecodeSettings.of(rollout)
    bw, source = memory_bandwidth()
    rng = np.random.default_rng(seed)
    sampling = RequestSampling(temperature=1.0, seed=seed)
    out: dict[str, Any] = {"model": "Qwen2.5-1.5B shape, random weights" + (" (quick: 2-layer body)" if quick else ""),
                           "quick": quick, "prompt_tokens": prompt, "max_new_tokens": max_out, "batches": {}}
    for b in batches:
        eng = Engine(model, max_concurrent_decodes=b, max_prefill_length=prompt, max_target_length=target,
                     dtype="bfloat16", settings=settings)
        prepared = eng.prepare_params(eng.params)
        n = 2 * b
        lengths = _lengths(n, rng, p50=p50, tail=max_out, max_len=max_out)
        reqs = [Request(i, tuple(rng.integers(3, eng.cfg.vocab_size, prompt).tolist()), max_new_tokens=int(k),
                        sampling=sampling) for i, k in enumerate(lengths)]
        warm = warm_engine(eng, prepared)
        # The prompts' prefill and insertion once more before timing (every program is compiled already).
        s = measure_decode(eng, prepared, reqs, warmup=[dataclasses.replace(r, max_new_tokens=1) for r in reqs])
        s.update(warm)
        s["kernels_per_layer_step"] = kernels_per_layer_step(s)
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(prepared.tree))
        token_bytes = kv_token_bytes(eng.cfg)
        _roofline(s, weight_bytes, token_bytes, bw)
        s.update(weight_bytes=weight_bytes, kv_token_bytes=token_bytes, dtype=eng.dtype,
                 attention_impl=resolve_attention_impl(eng.settings),
                 output_lengths={"p50": float(np.percentile(lengths, 50)), "p99": float(np.percentile(lengths, 99)),
                                 "max": int(max(lengths)), "total": int(sum(lengths))})
        out["batches"][str(b)] = s
        print(f"accel batch {b}: {s['tokens_per_s']:.1f} tokens/s, decode step {s['decode_step_ms']:.2f} ms "
              f"(roofline {s['roofline_decode_step_ms']:.2f} ms)", flush=True)
        if profile and b == max(batches):
            import json

            os.makedirs(profile, exist_ok=True)
            out["profile"] = profile_decode(eng, prepared, reqs, profile)
            with open(os.path.join(profile, "top_ops.json"), "w") as f:
                json.dump(out["profile"], f, indent=1)
        del eng, prepared
    top = _top_level("accel", out["batches"][str(max(batches))], bw, source, None)
    top["batch"] = max(batches)
    return {**top, **out, "machine": machine()}


def bench_engine_cpu(quick: bool = False, with_hf: bool = True, rounds: int = 3, seed: int = 0) -> dict[str, Any]:
    """``bench engine --preset cpu``: SmolLM2-135M in float32, the workload of ``bench engine`` (its every part
    under ``detail``), and the fixed batch once more on its own for the decode roofline and the driver's
    figures. Top-level ``tokens_per_s`` and ``hf_tokens_per_s`` are the fixed batch's alternated best.

    ``quick``: 8 sequences of 32 tokens and the long tail over 16 requests in 8 slots, one round each, the
    later parts (GRPO groups, overlap, shared prefix, decode steps per program) left out.
    """
    sizes = (dict(batch=8, new_tokens=32, tail_requests=16, tail_slots=8, rounds=1, all_parts=False) if quick
             else dict(rounds=rounds))
    detail = bench_engine("smollm2_135m", with_hf=with_hf, overrides=("rollout.dtype=float32",), seed=seed,
                          decode_summary=True, **sizes)
    s = detail.pop("decode_summary")
    top = _top_level("cpu", s, s.pop("bandwidth_bytes_s"), s.pop("bandwidth_source"), detail.get("hf_tok_s"))
    top.update(tokens_per_s=detail["engine_tok_s"], batch=detail["batch"], quick=quick)
    batch = detail["batch"]
    return {**top, "batches": {str(batch): s}, "detail": detail, "machine": machine()}


def profile_decode(eng, prepared, requests, out_dir: str, dispatches: int = 4) -> dict[str, Any]:
    """Where a steady decode dispatch's time goes, op by op: ``requests`` run on a fresh driver for two
    dispatches (the first fills every slot), then ``dispatches`` dispatches run under ``jax.profiler`` (the trace is kept in ``out_dir``); the
    trace's events of the widest decode program's ops are summed by op.

    Returns:
      ``steps`` traced, ``trace_dir``, and ``top_ops``: the 25 ops that took the most time, each with ``op``,
      ``count`` (launches), ``ms_per_step`` and ``result`` (its result shape in the compiled HLO).
    """
    import collections
    import glob
    import gzip
    import json
    import re

    from dora_jax.rollout.driver import RolloutDriver
    from dora_jax.rollout.warmup import warmup_plan

    results = {}  # every decode program's ops (a dispatch runs the one of its capacity), compiled at warm-up
    for name, args in warmup_plan(eng, prepared):
        if name == "generate_steps":
            hlo = eng.compiled.lower(name, *args).compile().as_text()
            results.update((m.group(1), m.group(2)) for m in re.finditer(r"^\s*(?:ROOT )?%(\S+) = (\S+) ", hlo, re.M))
    d = RolloutDriver(eng)
    d.add_version(0, prepared)
    for r in requests:
        d.submit(r)
    for _ in range(2):  # the first dispatch admits into every slot; the next one runs them all
        d.step()
    before = d.stats.steps
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for _ in range(dispatches):
            d.step()
        d.block_until_ready()
    steps = max(d.stats.steps - before, 1)
    trace = json.load(gzip.open(sorted(glob.glob(f"{out_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total, count = collections.defaultdict(float), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in results:
            total[e["name"]] += e["dur"] / 1e3
            count[e["name"]] += 1
    top = sorted(total.items(), key=lambda kv: -kv[1])[:25]
    return {"steps": steps, "trace_dir": out_dir,
            "top_ops": [{"op": op, "count": count[op], "ms_per_step": ms / steps, "result": results[op]}
                        for op, ms in top]}
