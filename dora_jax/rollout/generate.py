"""Batch generation for a quick look at a model (``dora-jax generate``, the demo, tests).

A static batch: prompts are right-padded to a power-of-two bucket, prefilled in one call, then decoded one
token per step until every row has finished. The continuous-batching engine builds on the same two jitted
functions (:func:`prefill_fn`, :func:`decode_step_fn`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dora_jax.models.decoder import Decoder, KVCache, init_cache
from dora_jax.rollout.sampling import SamplingParams, row_keys, sample


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum): bounds the number of compiled shapes."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


@dataclasses.dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "eos" | "length"


def prefill_fn(graphdef: nnx.GraphDef):
    """``(state, tokens_bt, lengths_b, cache, sample_ids_b, seed, sampling) -> (first tokens, logprobs, cache)``."""

    def prefill(state, tokens_bt, lengths_b, cache, sample_ids_b, seed, sampling: SamplingParams):
        model = nnx.merge(graphdef, state)
        b, t = tokens_bt.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, cache = model.decode(tokens_bt, positions, cache)
        last = jnp.take_along_axis(logits, (lengths_b - 1)[:, None, None], axis=1)[:, 0]
        tokens, logprobs = sample(last, row_keys(seed, sample_ids_b, lengths_b), sampling)
        return tokens, logprobs, cache

    return prefill


def decode_step_fn(graphdef: nnx.GraphDef):
    """``(state, tokens_b, positions_b, cache, sample_ids_b, seed, sampling) -> (next tokens, logprobs, cache)``;
    ``positions_b`` is where ``tokens_b`` sits, the sampled token goes at ``positions_b + 1``."""

    def step(state, tokens_b, positions_b, cache, sample_ids_b, seed, sampling: SamplingParams):
        model = nnx.merge(graphdef, state)
        logits, cache = model.decode(tokens_b[:, None], positions_b[:, None], cache)
        tokens, logprobs = sample(logits[:, 0], row_keys(seed, sample_ids_b, positions_b + 1), sampling)
        return tokens, logprobs, cache

    return step


class Generator:
    """Jitted prefill and decode for one model; compiled once per (batch, bucket) shape."""

    def __init__(self, model: Decoder):
        self.cfg = model.cfg
        self.graphdef, self.state = nnx.split(model)
        self._prefill = jax.jit(prefill_fn(self.graphdef), donate_argnums=(3,))
        self._step = jax.jit(decode_step_fn(self.graphdef), donate_argnums=(3,))

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, eos_ids: Sequence[int] = (),
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                 sample_ids: Sequence[int] | None = None) -> tuple[list[Completion], dict[str, float]]:
        """Generates for every prompt; returns completions and timings (``prefill_s``, ``decode_s``,
        ``new_tokens``, ``tokens_per_s``)."""
        b = len(prompts)
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token")
        if longest + max_new_tokens > self.cfg.max_seq_len:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"model.max_seq_len ({self.cfg.max_seq_len})")
        t = bucket(longest)
        tokens = np.zeros((b, t), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        sids = jnp.asarray(np.arange(b) if sample_ids is None else np.asarray(sample_ids), jnp.int32)
        sampling = SamplingParams.make(b, temperature, top_k, top_p)
        cache = init_cache(self.cfg, b, bucket(t + max_new_tokens))

        t0 = time.perf_counter()
        tok, lp, cache = self._prefill(self.state, jnp.asarray(tokens), jnp.asarray(lengths), cache, sids, seed,
                                       sampling)
        tok.block_until_ready()
        t1 = time.perf_counter()
        out_tokens, out_lp = [np.asarray(tok)], [np.asarray(lp)]
        done = np.isin(out_tokens[0], list(eos_ids))
        positions = jnp.asarray(lengths)
        for _ in range(max_new_tokens - 1):
            if done.all():
                break
            tok, lp, cache = self._step(self.state, tok, positions, cache, sids, seed, sampling)
            positions = positions + 1
            out_tokens.append(np.asarray(tok))
            out_lp.append(np.asarray(lp))
            done |= np.isin(out_tokens[-1], list(eos_ids))
        t2 = time.perf_counter()

        toks = np.stack(out_tokens, 1)
        lps = np.stack(out_lp, 1)
        completions = []
        n_new = 0
        for i in range(b):
            row = toks[i].tolist()
            end = next((j for j, x in enumerate(row) if x in eos_ids), None)
            n = len(row) if end is None else end + 1
            n_new += n
            completions.append(Completion(list(prompts[i]), row[:n], lps[i, :n].tolist(),
                                          "eos" if end is not None else "length"))
        decode_tokens = max(n_new - b, 0)
        timings = {"prefill_s": t1 - t0, "decode_s": t2 - t1, "new_tokens": float(n_new),
                   "tokens_per_s": decode_tokens / max(t2 - t1, 1e-9)}
        return completions, timings
