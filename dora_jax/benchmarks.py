"""Benchmarks behind ``dora-jax bench``. Each returns a JSON-able dict; ratios are measured side by side in
one run, because the machines this runs on are shared and noisy.

References (transformers + torch) are optional: when absent, only our side is measured.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from typing import Any

import jax


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def bench_load(config: str = "smollm2_135m", repeats: int = 2, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Time to load the config's weights (GGUF dequantization included) and run one forward, ours vs
    transformers' own GGUF loader, best of ``repeats``."""

    from dora_jax.config import load_config
    from dora_jax.models.weights import load_model

    cfg = load_config(config, overrides)
    ours = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model, _ = load_model(cfg.model, progress=False)
        jax.block_until_ready(model.embed[...])
        ours.append(time.perf_counter() - t0)
        del model
    out: dict[str, Any] = {"config": config, "weights": cfg.model.weights, "ours_load_s": min(ours)}
    try:
        import torch  # noqa: F401
        import transformers
    except ImportError:
        return {**out, "hf_load_s": None, "machine": machine()}
    from dora_jax.models.weights import open_weights

    path = open_weights(cfg.model.weights).path
    if not path.endswith(".gguf"):
        path_kw = dict(pretrained_model_name_or_path=path)
    else:
        path_kw = dict(pretrained_model_name_or_path=os.path.dirname(path), gguf_file=os.path.basename(path))
    hf = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = transformers.AutoModelForCausalLM.from_pretrained(**path_kw)
        hf.append(time.perf_counter() - t0)
        del m
    return {**out, "hf_load_s": min(hf), "speedup": min(hf) / min(ours), "machine": machine()}


def measure_machine(seconds: float = 1.0) -> dict[str, float]:
    """Measured float32 matmul FLOP/s and memory read bandwidth (a sum over 256 MiB: what decode does to the
    weights)."""
    import jax.numpy as jnp

    def best(fn, *args):
        fn(*args).block_until_ready()
        times, t_end = [], time.perf_counter() + seconds
        while time.perf_counter() < t_end or len(times) < 3:
            t0 = time.perf_counter()
            fn(*args).block_until_ready()
            times.append(time.perf_counter() - t0)
        return min(times)

    n = 1024 if jax.default_backend() == "cpu" else 8192  # an accelerator needs a larger product to fill it
    a = jnp.ones((n, n), jnp.float32)
    flops = 2 * n**3 / best(jax.jit(lambda x, y: x @ y), a, a)
    big = jnp.ones((64 << 20,), jnp.float32)  # 256 MiB
    bw = big.nbytes / best(jax.jit(jnp.sum), big)
    return {"matmul_flop_s": flops, "read_bytes_s": bw}


def measure_matmul(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """Measured float32 FLOP/s of one [m, k] x [k, n] matmul: the rate decode's small-batch matmuls get."""
    import jax.numpy as jnp

    f = jax.jit(lambda x, y: x @ y)
    x, y = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
    f(x, y).block_until_ready()
    times, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(times) < 3:
        t0 = time.perf_counter()
        f(x, y).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2 * m * k * n / min(times)


def measure_matmul_chain(model_cfg, batch: int, rounds: int = 5, torch_device: str | None = None) -> dict:
    """A decode step's weight matmuls and nothing else, for ``batch`` rows: per layer the fused q|k|v, the
    output projection, the fused gate|up and the down projection, then the output head; each layer its own
    weight buffers (no slices of stacked arrays), every product's whole output used, no norms, attention,
    cache or sampling. Random weights of the model's shapes and compute dtype (the time does not depend on the
    values).

    Timed as one jitted XLA program in each weight layout of ``model.decode_weights`` (``in_out``: ``x @ W``;
    ``out_in``: ``W^T @ x^T`` as the decode step computes it) and, with ``torch_device``, as the same chain of
    ``torch.nn.functional.linear`` calls in torch (the library transformers runs); alternated, best of
    ``rounds`` each. No decode step of this model at this batch can be faster than its matmuls, so
    ``batch`` / the faster layout's time bounds the tokens/s a decode step built this way reaches here."""
    import jax.numpy as jnp
    import numpy as np

    from dora_jax.models.decoder import _dot_out_in

    c = model_cfg
    q, kv, d, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    shapes = {"qkv": (d, q + 2 * kv), "o": (q, d), "gate_up": (d, 2 * f), "down": (f, d)}  # [in, out]
    rng = np.random.default_rng(0)
    host = [{k: (0.02 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
            for _ in range(c.num_layers)]
    head = (0.02 * rng.standard_normal((c.vocab_size, d))).astype(np.float32)  # [V, D], as the tied head
    x0 = rng.standard_normal((batch, d)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, c.compute_dtype)  # noqa: E731
    layers, w_head, x_in = jax.tree.map(cast, host), cast(head), cast(x0)
    layers_t = jax.tree.map(lambda a: cast(np.ascontiguousarray(a.T)), host)  # [out, in]

    def chain(x, layers, w_head, dot):
        for w in layers:  # q times the k|v mean and gate times up: every output of a product is used
            h = dot(x, w["qkv"])
            x = x + dot(h[:, :q] * jnp.mean(h[:, q:], axis=1, keepdims=True), w["o"])
            g = dot(x, w["gate_up"])
            x = x + dot(g[:, :f] * g[:, f:], w["down"])
        return dot(x, w_head.T if dot is in_out else w_head)

    def in_out(x, w):
        return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    def out_in(x, w):
        return _dot_out_in(x[:, None], w, 1, jnp.float32)[:, 0].astype(x.dtype)

    runs, times = {}, {}
    for name, dot, ws in (("in_out", in_out, layers), ("out_in", out_in, layers_t)):
        fn = jax.jit(lambda x, ws, h, dot=dot: chain(x, ws, h, dot))
        fn(x_in, ws, w_head).block_until_ready()  # compile
        runs[name] = lambda fn=fn, ws=ws: fn(x_in, ws, w_head).block_until_ready()
    if torch_device is not None:
        import torch

        tdt = getattr(torch, c.compute_dtype)
        # torch.nn.functional.linear takes [out, in] weights, as transformers stores them.
        tl = [{k: torch.from_numpy(np.ascontiguousarray(v.T)).to(torch_device, tdt) for k, v in w.items()}
              for w in host]
        th, tx = torch.from_numpy(head).to(torch_device, tdt), torch.from_numpy(x0).to(torch_device, tdt)
        sync = torch.cuda.synchronize if torch_device == "cuda" else (lambda: None)
        lin = torch.nn.functional.linear

        def torch_chain():
            with torch.inference_mode():
                y = tx
                for w in tl:
                    h = lin(y, w["qkv"])
                    y = y + lin(h[:, :q] * h[:, q:].mean(dim=1, keepdim=True), w["o"])
                    g = lin(y, w["gate_up"])
                    y = y + lin(g[:, :f] * g[:, f:], w["down"])
                lin(y, th)
                sync()

        torch_chain()
        runs["torch"] = torch_chain
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    best = min(min(times["in_out"]), min(times["out_in"]))
    flops = 2 * batch * (c.num_layers * sum(a * b for a, b in shapes.values()) + c.vocab_size * d)
    out = {"matmul_only_flops": flops, "matmul_only_step_ms": 1e3 * best, "matmul_only_tok_s": batch / best,
           "matmul_only_flop_s": flops / best, "matmul_only_in_out_ms": 1e3 * min(times["in_out"]),
           "matmul_only_out_in_ms": 1e3 * min(times["out_in"])}
    if "torch" in times:
        out["torch_matmul_only_step_ms"] = 1e3 * min(times["torch"])
    return out


def _lengths(n: int, rng, p50: int, tail: int, max_len: int):
    """Long-tailed output lengths: most near p50, a few ~tail; p99/p50 >= 8 for tail >= 8 * p50."""
    import numpy as np

    base = rng.integers(max(1, p50 // 2), p50 * 3 // 2 + 1, n)
    heavy = rng.random(n) < 0.08
    return np.minimum(np.where(heavy, rng.integers(tail // 2, tail + 1, n), base), max_len).tolist()


def _alternated(runs: dict[str, Any], rounds: int) -> dict[str, list[float]]:
    """Calls each of ``runs`` (name -> a callable returning tokens/s) in turn, ``rounds`` times over, and returns
    every result by name: alternating spreads the machine's drift over all of them alike."""
    seen: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            seen[name].append(fn())
    return seen


def _best_alternated(runs: dict[str, Any], rounds: int) -> dict[str, float]:
    """:func:`_alternated`, each one's best."""
    return {k: max(v) for k, v in _alternated(runs, rounds).items()}


def hf_generate_run(prompts: list[list[int]], new_tokens: int, dtype: str, out: dict[str, Any]):
    """A callable that times transformers ``generate`` on SmolLM2's GGUF and returns tokens/s: ``prompts`` as one
    left-padded batch, exactly ``new_tokens`` tokens each sampled at temperature 1 without top-k, with
    transformers' own KV cache. On a GPU backend it runs on the GPU (torch's CUDA build) with TF32 matmuls
    allowed, as XLA's default float32 dot precision does there. Records ``torch_threads`` and ``hf_device``
    (and ``hf_allow_tf32``) in ``out``. None when torch or transformers is not installed."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from dora_jax.models.gguf import smollm2_gguf_path

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

    def run() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            seqs = hf.generate(inp, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=True, temperature=1.0, top_k=0, pad_token_id=0, eos_token_id=None)
            sync()
            seconds = time.perf_counter() - t0
        if tuple(seqs.shape) != (len(prompts), width + new_tokens):  # the rate counts exactly new_tokens a row
            raise RuntimeError(f"transformers generate returned {tuple(seqs.shape)} tokens, expected "
                               f"{(len(prompts), width + new_tokens)} ({new_tokens} new after {width})")
        return len(prompts) * new_tokens / seconds
    return run


def chat_prompts(tok, n: int, rng) -> list[list[int]]:
    """``n`` chat-templated prompts "What is a + b?", a and b drawn from the numpy generator ``rng``: the
    engine benchmark's (``np.random.default_rng(0)``)."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}]))
            for a, b in rng.integers(10, 1000, (n, 2))]


def run_fixed_batch(engine, params, prompts, new_tokens: int = 128, shared_prefix=(), overlap=None, seed: int = 0):
    """Every prompt through a fresh ``RolloutDriver`` for exactly ``new_tokens`` sampled tokens (temperature
    1, no stop); returns ``(tokens/s, driver, trajectories by sample id)``, timed until nothing dispatched is
    left running."""
    from dora_jax.rollout.driver import Request, RolloutDriver
    from dora_jax.rollout.engine import RequestSampling

    d = RolloutDriver(engine, overlap=overlap, shared_prefix=shared_prefix)
    d.add_version(0, params)
    sampling = RequestSampling(temperature=1.0, seed=seed)
    t0 = time.perf_counter()
    trajs = d.run([Request(i, tuple(p), max_new_tokens=new_tokens, sampling=sampling) for i, p in enumerate(prompts)])
    d.block_until_ready()
    rate = sum(len(t.tokens) for t in trajs) / (time.perf_counter() - t0)
    return rate, d, sorted(trajs, key=lambda t: t.sample_id)


def compare_fixed_batches(runs: dict[str, Any], rounds: int) -> None:
    """Two forms of the engine side by side: ``runs`` maps two names to callables returning ``(tokens/s,
    trajectories by sample id)``, as :func:`run_fixed_batch` does. Each is called once (compiling), then the
    two alternate ``rounds`` times; every round prints both rates, the second / the first, and how many
    trajectories have the same tokens in both."""
    (name_a, run_a), (name_b, run_b) = runs.items()
    run_a(), run_b()
    for _ in range(rounds):
        (a, ta), (b, tb) = run_a(), run_b()
        same = sum(x.tokens == y.tokens for x, y in zip(ta, tb))
        print(f"fixed batch: {name_a} {a:.1f}, {name_b} {b:.1f} tokens/s, {name_b} / {name_a} {b / a:.2f}x, "
              f"same tokens in {same} of {len(ta)} trajectories", flush=True)


def time_decode_steps(variants: dict[str, tuple[Any, Any]], model_cfg, batch: int, cache_len: int, position: int,
                      rounds: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Alternated timings of one decode step in several variants, for comparing forms of the step side by side.

    ``variants``: name -> ``(step, params)`` with ``step(params, tokens [B, 1], positions [B, 1], cache) ->
    (out, cache)`` jitted with the cache donated. Every row decodes token 0 at ``position`` into a cache of its
    own per variant. Rounds 0 and 1 compile (a fresh cache, then one the step returned) and are not timed;
    then ``rounds`` rounds, each calling every variant once in turn. Returns ``(seconds per variant, each
    variant's last output as numpy)``."""
    import jax.numpy as jnp
    import numpy as np

    from dora_jax.models.decoder import init_cache

    tokens = jnp.zeros((batch, 1), jnp.int32)
    positions = jnp.full((batch, 1), position, jnp.int32)
    caches = {k: init_cache(model_cfg, batch, cache_len) for k in variants}
    times: dict[str, list[float]] = {k: [] for k in variants}
    outs: dict[str, Any] = {}
    for r in range(rounds + 2):
        for k, (step, params) in variants.items():
            t0 = time.perf_counter()
            out, caches[k] = step(params, tokens, positions, caches[k])
            out.block_until_ready()
            if r > 1:
                times[k].append(time.perf_counter() - t0)
            outs[k] = out
    return times, {k: np.asarray(v) for k, v in outs.items()}


def bench_engine(config: str = "smollm2_135m", batch: int = 32, new_tokens: int = 128, tail_requests: int = 64,
                 tail_slots: int = 16, group_size: int = 4, seed: int = 0, with_hf: bool = True,
                 overrides: tuple[str, ...] = (), rounds: int = 3) -> dict[str, Any]:
    """The engine benchmark, side by side in one run: throughput at a fixed batch vs transformers (the two
    alternated ``rounds`` times: ``engine_tok_s`` and ``hf_tok_s`` are each one's best, every run is in
    ``fixed_batch_runs``, ``engine_vs_hf_median`` is the ratio of the medians) and vs the roofline;
    continuous batching vs a static batch on a long-tailed workload (alternated the same way,
    ``long_tail_runs``); on the same lengths in GRPO groups of ``group_size`` samples per prompt, one prefill
    per distinct prompt vs one per sample; and the fixed batch and the long tail's continuous run with and
    without host/device overlap (``RolloutDriver(overlap=...)``); and the long tail with and without the
    shared prefix.

    Every run prefills the chat template's head once per driver and each prompt after it, as a training run
    does with ``rollout.shared_prefix`` (the default; ``rollout.shared_prefix=false`` turns it off here too);
    the roofline counts that work: the head once, each prompt's tokens after it."""
    import numpy as np
    from flax import nnx

    from dora_jax.config import load_config
    from dora_jax.models.decoder import resolve_attention_impl
    from dora_jax.models.weights import load_model
    from dora_jax.rollout.driver import Request, RolloutDriver
    from dora_jax.rollout.engine import Engine, RequestSampling
    from dora_jax.tokenizer import chat_template_head
    from tqdm.auto import tqdm

    cfg = load_config(config, overrides)
    model, tok = load_model(cfg.model, progress=False)
    params = nnx.state(model)
    rng = np.random.default_rng(seed)
    if tok is not None:
        prompts = chat_prompts(tok, max(batch, tail_requests), rng)
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
    out: dict[str, Any] = {"config": config, "overrides": list(overrides), "batch": batch, "new_tokens": new_tokens,
                           "prompt_tokens": plen, "attention_impl": resolve_attention_impl(cfg.model),
                           "dtype": cfg.model.compute_dtype, "shared_prefix_tokens": len(head)}

    bar = tqdm(total=5, desc="bench engine", unit="part")  # five parts, minutes each on a CPU
    # 1. Fixed batch: `batch` sequences, `new_tokens` each (no early stop), sampling.
    eng = Engine(model, max_concurrent_decodes=batch, max_prefill_length=plen, max_target_length=target)

    def fixed_run(overlap=None):
        rate, d, _ = run_fixed_batch(eng, params, prompts[:batch], new_tokens, head, overlap, seed)
        return rate, d

    c = cfg.model
    # transformers `generate` at the same batch and sampling, timed alternately with the engine's run.
    hf_run = hf_generate_run(prompts[:batch], new_tokens, c.compute_dtype, out) if with_hf else None
    out["overlap"] = fixed_run()[1].overlap  # compiles
    runs = {"engine_tok_s": lambda: fixed_run()[0]}
    if hf_run is not None:
        runs["hf_tok_s"] = hf_run
    seen = _alternated(runs, rounds)
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
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
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
                                                  max_target_length=target)  # same slots: reuse its programs

    def continuous(overlap=None, prefix=head):
        d = RolloutDriver(eng2, overlap=overlap, shared_prefix=prefix)
        d.add_version(0, params)
        t0 = time.perf_counter()
        d.run(reqs)
        d.block_until_ready()
        return sum(lengths) / (time.perf_counter() - t0), d.slot_utilization

    def static(prefix=head):
        d = RolloutDriver(eng2, compact=False, shared_prefix=prefix)
        d.add_version(0, params)
        t0 = time.perf_counter()
        for i in range(0, len(reqs), tail_slots):
            d.run(reqs[i:i + tail_slots])
        return sum(lengths) / (time.perf_counter() - t0), d.slot_utilization

    continuous(), static()  # compile every capacity both use
    util: dict[str, float] = {}  # the same schedule every run: the utilization does not vary

    def recording(name, fn):
        def run():
            rate, util[name] = fn()
            return rate
        return run

    seen = _alternated({"continuous_tok_s": recording("continuous", continuous),
                        "static_tok_s": recording("static", static)}, rounds)
    out.update({k: max(v) for k, v in seen.items()}, long_tail_runs=seen, slot_utilization=util)
    out["continuous_vs_static"] = out["continuous_tok_s"] / out["static_tok_s"]

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
        t0 = time.perf_counter()
        d.run(grouped)
        return sum(lengths) / (time.perf_counter() - t0)

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
        best = _best_alternated({f"no_overlap_{name}tok_s": lambda: fn(False),
                                 f"overlap_{name}tok_s": lambda: fn(True)}, rounds=2 if secs > 2 else 5)
        out.update(best)
        out[f"overlap_{name}vs_none"] = best[f"overlap_{name}tok_s"] / best[f"no_overlap_{name}tok_s"]

    bar.update()
    bar.set_postfix_str("shared prefix")
    # 5. The shared prefix: the long tail's continuous and static runs with the template head prefilled once
    # (as above) and with every prompt prefilled whole; alternated, best of two each.
    if head:
        continuous(prefix=()), static(prefix=())  # compile the whole-prompt buckets
        out.update(_best_alternated({"no_prefix_continuous_tok_s": lambda: continuous(prefix=())[0],
                                     "no_prefix_static_tok_s": lambda: static(prefix=())[0],
                                     "prefix_continuous_tok_s": lambda: continuous(prefix=head)[0],
                                     "prefix_static_tok_s": lambda: static(prefix=head)[0]}, rounds=2))
        for name in ("prefix", "no_prefix"):
            out[f"{name}_continuous_vs_static"] = out[f"{name}_continuous_tok_s"] / out[f"{name}_static_tok_s"]
        out["prefix_vs_none_continuous"] = out["prefix_continuous_tok_s"] / out["no_prefix_continuous_tok_s"]
    bar.update()
    bar.close()
    out["machine"] = machine()
    return out


def bench_prefill(config: str = "smollm2_135m", prompt_len: int = 41, batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                  repeats: int = 3, seed: int = 0, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """``Engine.prefill_batch`` alone: seconds per program and per prompt for 1..32 distinct prompts of
    ``prompt_len`` tokens (best of ``repeats``, first tokens read back), to see what one program buys."""
    import numpy as np
    from flax import nnx

    from dora_jax.config import load_config
    from dora_jax.models.weights import load_model
    from dora_jax.rollout.engine import Engine, RequestSampling
    from tqdm.auto import tqdm

    cfg = load_config(config, overrides)
    model, _ = load_model(cfg.model, progress=False)
    eng = Engine(model, max_concurrent_decodes=max(batches), max_prefill_length=prompt_len,
                 max_target_length=2 * (1 << (prompt_len - 1).bit_length()))
    params = eng.prepare_params(nnx.state(model))
    rng = np.random.default_rng(seed)
    sampling = RequestSampling(temperature=1.0, seed=seed)
    out: dict[str, Any] = {"config": config, "prompt_len": prompt_len, "runs": []}
    for n in tqdm(batches, desc="bench prefill", unit="batch"):
        prompts = [tuple(rng.integers(1, cfg.model.vocab_size, prompt_len).tolist()) for _ in range(n)]

        def once():
            batch, first = eng.prefill_batch(params=params, prompts=prompts, sample_ids=list(range(n)),
                                             samplings=[sampling] * n)
            first.to_host().columns()
            jax.block_until_ready(batch)

        once()  # compile
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        out["runs"].append({"prompts": n, "s": min(times), "s_per_prompt": min(times) / n})
    out["machine"] = machine()
    return out


def bench_decode(config: str = "smollm2_135m", batch: int = 32, cache_length: int = 256,
                 repeats: int = 5, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Where one decode step's time goes: the full step against a ``cache_length`` cache, the same forward
    without a cache (layers + head only), and sampling alone; best of ``repeats`` after compiling."""
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dora_jax.config import load_config
    from dora_jax.models.decoder import decode_forward, init_cache, resolve_decode_weights
    from dora_jax.models.weights import load_model
    from dora_jax.rollout.sampling import SamplingParams, row_keys, sample

    cfg = load_config(config, overrides)
    model, _ = load_model(cfg.model, progress=False)
    graphdef, params = nnx.split(model)

    def best(fn, *args):
        out = fn(*args)
        jax.block_until_ready(out)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = fn(*args)
            jax.block_until_ready(out)
            times.append(time.perf_counter() - t0)
        return min(times)

    tokens = jnp.zeros((batch, 1), jnp.int32)
    positions = jnp.full((batch, 1), cache_length // 2, jnp.int32)
    cache = init_cache(cfg.model, batch, cache_length)
    # As in the engine: fused params prepared once, the cache donated and threaded from step to step.
    prepared = model.decode_params(fuse=True, transpose=resolve_decode_weights(cfg.model) == "out_in")
    step = jax.jit(lambda p, t, pos, c: decode_forward(cfg.model, p, t, pos, c), donate_argnums=(3,))
    dense = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(batch, cfg.model.vocab_size)), jnp.float32)
    keys = row_keys(0, jnp.arange(batch), jnp.zeros(batch, jnp.int32))
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out, cache = step(prepared, tokens, positions, cache)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    full_s = min(times[1:])
    dense_s = best(dense, params, tokens)
    sp = SamplingParams.make(batch, 1.0)
    # The variant the driver runs when no request uses top-k / top-p, and the run-time choice (a lax.cond).
    sample_s = best(jax.jit(sample, static_argnums=3), logits, keys, sp, False)
    sample_cond_s = best(jax.jit(sample), logits, keys, sp)
    return {"config": config, "batch": batch, "cache_length": cache_length, "decode_step_ms": 1e3 * full_s,
            "layers_and_head_ms": 1e3 * dense_s, "kv_cache_part_ms": 1e3 * (full_s - dense_s),
            "sampling_ms": 1e3 * sample_s, "sampling_runtime_choice_ms": 1e3 * sample_cond_s,
            **measure_matmul_chain(cfg.model, batch), "machine": machine()}


def _synthetic_samples(rng, rows: int, prompt_len: int, response_len: int, vocab_size: int) -> list:
    """Random finished samples in groups of 4, the batch the train-step benchmarks time."""
    from dora_jax.trainer import Sample

    return [Sample(i, i // 4, 0, rng.integers(1, vocab_size, prompt_len).tolist(),
                   rng.integers(1, vocab_size, response_len).tolist(),
                   (-rng.uniform(0.5, 5.0, response_len)).tolist(), float(rng.normal())) for i in range(rows)]


def _bench_trainer(cfg, samples: list, seq: int, response_len: int, lora_rank: int, **train_overrides):
    """A fresh model, trainer, state and device batch for the train-step benchmarks (groups of 4, one length
    bucket, full fine-tuning when ``lora_rank`` is 0)."""
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
                lora_rank: int = 16, repeats: int = 3, seed: int = 0, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """Training tokens/s of the jitted, donated train step, full fine-tuning and LoRA, with model FLOP
    utilization against the matmul rate measured in the same run; best of ``repeats`` steps after compiling.

    Rows are random token sequences (``prompt_len`` + ``response_len``) in groups of 4 with random rewards:
    the step's cost does not depend on the tokens.
    """

    import numpy as np

    from dora_jax.config import load_config

    cfg = load_config(config, overrides)
    rng = np.random.default_rng(seed)
    seq = prompt_len + response_len
    samples = _synthetic_samples(rng, rows, prompt_len, response_len, cfg.model.vocab_size)
    machine_rates = measure_machine()
    out: dict[str, Any] = {"config": config, "rows": rows, "seq_len": seq, "tokens_per_step": rows * seq,
                           "response_tokens_per_step": rows * response_len, "lora_rank": lora_rank,
                           **machine_rates}
    for name, rank in (("full", 0), ("lora", lora_rank)):
        run_cfg, trainer, state, batch = _bench_trainer(cfg, samples, seq, response_len, rank)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            state, metrics = trainer.train_step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
        step_s = min(times[1:])
        flops = train_flops(cfg.model, rows * seq, seq, lora=rank > 0)
        out[name] = {"compile_and_first_step_s": times[0], "step_s": step_s, "tokens_s": rows * seq / step_s,
                     "model_flops": flops, "mfu": flops / step_s / machine_rates["matmul_flop_s"],
                     "skipped": float(metrics["skipped"])}
        del trainer, state, batch
    out["lora_vs_full"] = out["lora"]["tokens_s"] / out["full"]["tokens_s"]
    out["machine"] = machine()
    return out


def bench_snapshot(config: str = "smollm2_135m", rows: int = 8, prompt_len: int = 32, response_len: int = 96,
                   lora_rank: int = 16, baseline_steps: int = 2, snapshot_steps: int = 3, seed: int = 0,
                   directory: str | None = None, overrides: tuple[str, ...] = ()) -> dict[str, Any]:
    """How long an asynchronous version snapshot blocks the trainer, against the train step's time, and the
    memory each resident version holds; full fine-tuning and LoRA.

    Each mode runs a compiling step, ``baseline_steps`` steps without snapshots, then ``snapshot_steps``
    steps each followed by ``VersionStore.publish`` (copy into the store + Orbax snapshot started). The
    blocked time is ``publish``'s wall time: the copy, the device-to-host transfer, and any wait for the
    previous write; the file writing itself overlaps the next step. The first publish (Orbax set-up) is
    reported apart.
    """
    import statistics
    import tempfile

    import numpy as np
    from tqdm.auto import tqdm

    from dora_jax.config import load_config
    from dora_jax.versions import Snapshots, VersionStore

    cfg = load_config(config, overrides)
    rng = np.random.default_rng(seed)
    seq = prompt_len + response_len
    samples = _synthetic_samples(rng, rows, prompt_len, response_len, cfg.model.vocab_size)
    out: dict[str, Any] = {"config": config, "rows": rows, "seq_len": seq, "lora_rank": lora_rank,
                           "baseline_steps": baseline_steps, "snapshot_steps": snapshot_steps}
    bar = tqdm(total=2 * (2 + baseline_steps + snapshot_steps), desc="bench snapshot", unit="step")
    for name, rank in (("full", 0), ("lora", lora_rank)):
        run_cfg, trainer, state, batch = _bench_trainer(cfg, samples, seq, response_len, rank, max_staleness=1)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            snaps = Snapshots(tmp, fingerprint=run_cfg.fingerprint(), keep_last=2)
            t0 = time.perf_counter()
            store = VersionStore.from_config(run_cfg, base=state.frozen, snapshots=snaps)
            store.publish(0, state.params, step=0)
            first_publish_s = time.perf_counter() - t0
            snaps.wait()

            def step(state):
                t = time.perf_counter()
                state, metrics = trainer.train_step(state, batch)
                jax.block_until_ready(metrics)
                bar.update()
                return state, time.perf_counter() - t

            state, compile_s = step(state)
            base_times, snap_times, blocked = [], [], []
            for _ in range(baseline_steps):
                state, t = step(state)
                base_times.append(t)
            for i in range(snapshot_steps):
                state, t = step(state)
                snap_times.append(t)
                t0 = time.perf_counter()
                store.publish(i + 1, state.params, step=int(state.step))
                blocked.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            snaps.wait()
            drain_s = time.perf_counter() - t0
            # one snapshot from start to committed files, for scale
            t0 = time.perf_counter()
            snaps.save(10_000, store.stored(store.newest), step=-1)
            snaps.wait()
            write_s = time.perf_counter() - t0
            disk = sum(f.stat().st_size for f in (snaps.path(10_000)).rglob("*") if f.is_file())
            bar.update()
            snaps.close()
        step_s = statistics.median(base_times)
        out[name] = {"compile_and_first_step_s": compile_s, "step_s": step_s,
                     "step_s_with_snapshots": statistics.median(snap_times),
                     "blocked_s": statistics.median(blocked), "blocked_max_s": max(blocked),
                     "blocked_fraction_of_step": statistics.median(blocked) / step_s,
                     "first_publish_s": first_publish_s, "last_write_drain_s": drain_s,
                     "snapshot_write_s": write_s, "snapshot_disk_bytes": disk,
                     "resident_bytes_per_version": store.resident_bytes()[store.newest],
                     "shared_bytes": store.shared_bytes()}
        del trainer, state, batch, store
    bar.close()
    out["lora_vs_full_bytes_per_version"] = (out["lora"]["resident_bytes_per_version"]
                                             / out["full"]["resident_bytes_per_version"])
    out["machine"] = machine()
    return out
