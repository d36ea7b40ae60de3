"""Accuracy of one policy version on a task's held-out questions: :func:`evaluate` decodes them with a driver
of its own; an evaluation during training (:mod:`dora_jax.run.evals`) submits the same :func:`heldout_requests`
to the run's driver; both score into one :func:`heldout_result`.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from dora_jax.config import Config
from dora_jax.rewards import RewardPool, RewardResult
from dora_jax.rollout.driver import RolloutDriver
from dora_jax.rollout.engine import Engine, RequestSampling
from dora_jax.rollout.samples import Request, Trajectory
from dora_jax.tasks import Item, Score, Task
from dora_jax.tasks.base import score_answer

log = logging.getLogger(__name__)

# Held-out answers' sample ids start here (answer k of question i: EVAL_IDS + k * questions + i), above every id
# a run's ledger hands out (those count up from 0), so a run's driver can decode both side by side.
EVAL_IDS = 1 << 30


class RunError(RuntimeError):
    """A run that cannot continue: the message names what and where."""


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The token ids of ``prompt`` as a one-turn chat, ready for the assistant's answer."""
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


# ``(reward, correct)`` of one answer, run in the reward pool's worker processes; it lives in dora_jax.tasks, which
# the workers have imported already, so a worker never imports this module (and JAX) to unpickle it.
score = score_answer


def heldout_requests(cfg: Config, task: Task, tokenizer: Any, engine: Engine, version: int
                     ) -> tuple[list[Item], list[Request]]:
    """The held-out questions and their ``task.eval_samples`` answers each as requests on ``version``. An answer's
    sampling stream depends only on its question's position (sample id from :data:`EVAL_IDS`, ``rollout.seed``).

    Raises:
      RunError: a held-out question does not fit the engine (named with the settings that bound it).
    """
    tc, items = cfg.task, task.eval_items()
    n_new = tc.eval_max_new_tokens
    prompts = [tuple(prompt_ids(tokenizer, it.prompt)) for it in items]
    budgets = [min(it.max_new_tokens or n_new, n_new) for it in items]
    for i, (p, n) in enumerate(zip(prompts, budgets)):  # named by the settings, before any decoding
        if len(p) > engine.max_prefill_length or len(p) + n > engine.max_target_length:
            raise RunError(
                f"task {task.name!r}: held-out question {i} has {len(p)} prompt tokens and may generate {n} "
                f"(task.eval_max_new_tokens = {n_new}), but the rollout engine takes prompts of at most "
                f"{engine.max_prefill_length} tokens (rollout.max_prompt_len) and {engine.max_target_length} "
                "positions in all (rollout.max_prompt_len + rollout.max_new_tokens, rounded up to a power of two)")
    sampling = RequestSampling(temperature=tc.eval_temperature, seed=cfg.rollout.seed + 7919)
    return items, [Request(EVAL_IDS + k * len(items) + i, p, version=version, max_new_tokens=n, sampling=sampling)
                   for k in range(tc.eval_samples) for i, (p, n) in enumerate(zip(prompts, budgets))]


def heldout_result(cfg: Config, task: Task, version: int, items: Sequence[Item],
                   answers: Sequence[tuple[Trajectory, RewardResult]]) -> dict[str, float]:
    """The result of an evaluation from its scored answers; a failed score counts as wrong with reward 0, named
    in a warning.

    Returns:
      ``accuracy`` (pass@1 over all answers), ``pass_at_k`` (questions with a correct answer among their ``k`` =
      ``task.eval_samples``), ``k``, ``reward`` (mean), ``n`` (answers), ``len_mean`` (answer tokens) and
      ``score_errors``; NaN figures without questions.

    Raises:
      RunError: every answer failed to score.
    """
    if not items:
        return {"accuracy": float("nan"), "pass_at_k": float("nan"), "k": cfg.task.eval_samples,
                "reward": float("nan"), "n": 0, "len_mean": float("nan"), "score_errors": 0}
    answers = sorted(answers, key=lambda a: a[0].sample_id)
    scores, failed = [], []
    for t, r in answers:
        if r.error:
            failed.append(f"held-out question {(t.sample_id - EVAL_IDS) % len(items)}: {r.error}")
        scores.append(Score(0.0, False) if r.error else Score(r.reward, r.correct))
    if failed:
        what = f"task {task.name!r}: scoring failed on {len(failed)} of {len(answers)} held-out answers"
        if len(failed) == len(answers):
            raise RunError(f"{what} (version {version}); the first: {failed[0]}")
        log.warning("%s (version %d, counted as wrong with reward 0); the first: %s", what, version, failed[0])
    solved = np.zeros((len(items),), bool)  # a question counts for pass@k when any of its k answers is correct
    for (t, _), s in zip(answers, scores):
        solved[(t.sample_id - EVAL_IDS) % len(items)] |= s.correct
    return {"accuracy": float(np.mean([s.correct for s in scores])), "pass_at_k": float(np.mean(solved)),
            "k": cfg.task.eval_samples, "reward": float(np.mean([s.reward for s in scores])), "n": len(scores),
            "len_mean": float(np.mean([len(t.tokens) for t, _ in answers])), "score_errors": len(failed)}


def evaluate(cfg: Config, task: Task, engine: Engine, tokenizer: Any, params: Any, version: int,
             shared_prefix: tuple[int, ...] = ()) -> dict[str, float]:
    """Accuracy on ``task``'s held-out set with ``params`` (version ``version``, on ``engine``'s devices):
    ``task.eval_samples`` answers per question at ``task.eval_temperature`` (0: greedy), scored as in training.
    Returns :func:`heldout_result`'s figures.

    Raises:
      RunError: a held-out question does not fit the engine, or every answer failed to score.
    """
    items, reqs = heldout_requests(cfg, task, tokenizer, engine, version)
    if not items:
        return heldout_result(cfg, task, version, items, [])
    driver = RolloutDriver(engine, eos_ids=tokenizer.eos_ids, overlap=cfg.rollout.overlap, shared_prefix=shared_prefix)
    driver.add_version(version, params)
    trajs = driver.run(reqs)
    tc = cfg.task
    pool, results = RewardPool(tc.reward_workers, tc.reward_timeout_s), {}
    try:
        for t in trajs:
            pool.submit(t.sample_id, score, task, items[(t.sample_id - EVAL_IDS) % len(items)],
                        tokenizer.decode(t.tokens, skip_special_tokens=True))
        while pool.outstanding:
            results.update((r.key, r) for r in pool.poll(0.05))
    finally:
        pool.close()
    return heldout_result(cfg, task, version, items, [(t, results[t.sample_id]) for t in trajs])
