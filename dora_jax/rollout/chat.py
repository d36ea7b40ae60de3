"""Chat-style generation from a config: load the model and tokenizer, apply the chat template, decode.

Used by ``dora-jax generate`` and the demo; importable for notebooks.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

from dora_jax.config import Config
from dora_jax.models.decoder import DecodeSettings
from dora_jax.models.hf_io import WeightsError
from dora_jax.models.weights import load_model
from dora_jax.rollout.engine import Engine, RequestSampling
from dora_jax.rollout.generate import engine_for, generate
from dora_jax.sharding import create_mesh


@dataclasses.dataclass
class ChatResult:
    prompt: str
    answer: str
    new_tokens: int
    finish_reason: str


def load_chat_model(cfg: Config, progress: bool = True) -> tuple[Any, Any, float]:
    """Returns ``(model, tokenizer, load_seconds)``; the model is placed on the config's mesh."""
    t0 = time.perf_counter()
    mesh = create_mesh(cfg.mesh)
    model, tokenizer = load_model(cfg.model, mesh, cfg.mesh.logical_axis_rules, seed=cfg.run.seed, progress=progress)
    if tokenizer is None:
        if not cfg.model.weights:
            raise WeightsError("model.weights is not set (random init): generation needs the tokenizer that comes "
                               "with weights; set model.weights (e.g. smollm2) or pass --weights")
        raise WeightsError(f"model.weights={cfg.model.weights!r} carries no tokenizer (a Hugging Face directory "
                           "needs tokenizer.json beside config.json); generation needs one")
    return model, tokenizer, time.perf_counter() - t0


def chat_prompts(tokenizer: Any, prompts: Sequence[str], cfg: Config) -> list[list[int]]:
    """Token ids of each prompt as one user turn (after the optional system prompt), ready for the answer."""
    ids = []
    for p in prompts:
        messages = ([{"role": "system", "content": cfg.generate.system_prompt}] if cfg.generate.system_prompt
                    else []) + [{"role": "user", "content": p}]
        ids.append(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True)))
    return ids


def chat_engine(model: Any, tokenizer: Any, prompts: Sequence[str], cfg: Config) -> Engine:
    """An engine sized for these prompts (reuse it to time a second, compiled call), decoding in
    ``rollout.dtype`` with the rollout section's decode settings."""
    return engine_for(model, chat_prompts(tokenizer, prompts, cfg), cfg.generate.max_new_tokens,
                      dtype=cfg.rollout.dtype, settings=DecodeSettings.of(cfg.rollout))


def chat(model: Any, tokenizer: Any, prompts: Sequence[str], cfg: Config,
         engine: Engine | None = None) -> tuple[list[ChatResult], dict[str, float]]:
    """Answers each prompt as one user turn of a chat; returns results and timings."""
    g = cfg.generate
    sampling = RequestSampling(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p, seed=g.seed)
    engine = engine or chat_engine(model, tokenizer, prompts, cfg)
    trajs, timings = generate(model, chat_prompts(tokenizer, prompts, cfg), max_new_tokens=g.max_new_tokens,
                              eos_ids=tokenizer.eos_ids, sampling=sampling, engine=engine)
    results = [ChatResult(p, tokenizer.decode(t.tokens, skip_special_tokens=True).strip(), len(t.tokens),
                          t.finish_reason) for p, t in zip(prompts, trajs)]
    return results, timings
