"""What the machine itself reaches, measured in the same run as a benchmark: the matmul rate, the read bandwidth
and a decode step's weight matmuls alone. The engine, decode and train benchmarks divide by these."""

from __future__ import annotations

from typing import Any

import jax

from benchmarks.timing import alternated_times, best_of


def measure_machine(seconds: float = 1.0) -> dict[str, float]:
    """Measured float32 matmul rate and memory read bandwidth.

    Args:
      seconds: how long to time each, best call kept (three calls at least).

    Returns:
      ``matmul_flop_s`` (an ``n x n`` product: 1024 on CPU, 8192 on an accelerator, which needs a larger one to
      fill it) and ``read_bytes_s`` (a sum over 256 MiB: what decode does to the weights).
    """
    import jax.numpy as jnp

    n = 1024 if jax.default_backend() == "cpu" else 8192
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x, y: x @ y)
    flops = 2 * n**3 / best_of(lambda: matmul(a, a), seconds=seconds)
    big = jnp.ones((64 << 20,), jnp.float32)  # 256 MiB
    total = jax.jit(jnp.sum)
    bw = big.nbytes / best_of(lambda: total(big), seconds=seconds)
    return {"matmul_flop_s": flops, "read_bytes_s": bw}


def measure_matmul(m: int, k: int, n: int, seconds: float = 0.5) -> float:
    """Measured float32 FLOP/s of one ``[m, k] x [k, n]`` matmul: the rate decode's small-batch matmuls get.

    Args:
      m, k, n: the product's shape.
      seconds: how long to time it, best call kept (three calls at least).

    Returns:
      FLOP/s.
    """
    import jax.numpy as jnp

    f = jax.jit(lambda x, y: x @ y)
    x, y = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
    return 2 * m * k * n / best_of(lambda: f(x, y), seconds=seconds)


def measure_matmul_chain(model_cfg, batch: int, rounds: int = 5, torch_device: str | None = None) -> dict[str, Any]:
    """A decode step's weight matmuls and nothing else, for ``batch`` rows.

    Per layer the fused q|k|v, the output projection, the fused gate|up and the down projection, then the
    output head; each layer its own weight buffers (no slices of stacked arrays), every product's whole output
    used, no norms, attention, cache or sampling. Random weights of the model's shapes and compute dtype (the
    time does not depend on the values).

    Timed as one jitted XLA program (``x @ W``, as the decode step computes it) and, with ``torch_device``, as
    the same chain of ``torch.nn.functional.linear`` calls in torch (the library transformers runs);
    alternated, best of ``rounds`` each. No decode step of this model at this batch can be faster than its
    matmuls, so ``batch`` / the XLA time bounds the tokens/s a decode step built this way reaches here.

    Args:
      model_cfg: the model's ``ModelConfig``.
      batch: rows.
      rounds: alternated timed rounds.
      torch_device: also time torch on this device (``"cpu"`` or ``"cuda"``); None: XLA only.

    Returns:
      ``matmul_only_*`` figures (FLOPs, step ms, tokens/s, FLOP/s) and, with torch,
      ``torch_matmul_only_step_ms``.
    """
    import jax.numpy as jnp
    import numpy as np

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

    def dot(x, w):
        return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    @jax.jit
    def chain(x, layers, w_head):
        for w in layers:  # q times the k|v mean and gate times up: every output of a product is used
            h = dot(x, w["qkv"])
            x = x + dot(h[:, :q] * jnp.mean(h[:, q:], axis=1, keepdims=True), w["o"])
            g = dot(x, w["gate_up"])
            x = x + dot(g[:, :f] * g[:, f:], w["down"])
        return dot(x, w_head.T)

    chain(x_in, layers, w_head).block_until_ready()  # compile
    runs = {"xla": lambda: chain(x_in, layers, w_head)}
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
    times = alternated_times(runs, rounds)
    best = min(times["xla"])
    flops = 2 * batch * (c.num_layers * sum(a * b for a, b in shapes.values()) + c.vocab_size * d)
    out = {"matmul_only_flops": flops, "matmul_only_step_ms": 1e3 * best, "matmul_only_tok_s": batch / best,
           "matmul_only_flop_s": flops / best}
    if "torch" in times:
        out["torch_matmul_only_step_ms"] = 1e3 * min(times["torch"])
    return out
