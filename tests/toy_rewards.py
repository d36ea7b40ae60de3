"""Reward functions that tests name in ``task.reward`` (``toy_rewards:NAME``).

A run's reward workers import the module of its reward function, once per worker (dora_jax/rewards.py), and a
worker is replaced after every timeout. A test module imports JAX and the whole library through conftest (seconds
of CPU per worker), so the functions live here, in a module that imports nothing heavy: the standard library and
``dora_jax.config`` / ``dora_jax.tasks``, which the workers have loaded already.
"""

from __future__ import annotations

import functools
import os
import time

# The test runs' task: tests/test_runner.py's BASE settings on the tiny_llama preset (their first question).
RUNNER_TASK = ["task.name=longtail", "task.longtail_max_len=24", "task.eval_size=4"]


@functools.cache
def first_question() -> str:
    from dora_jax.config import load_config
    from dora_jax.tasks import load_task

    return load_task(load_config("tiny_llama", RUNNER_TASK).task).train_item(0).prompt


def _digits(response: str) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def _mean_char_code(response: str) -> float:
    return sum(min(ord(c), 255) for c in response) / len(response) / 255 if response else 0.0


def fails_on(prompt: str, response: str) -> bool:
    """Where the two reward functions below fail: on responses that start with a lower-case letter (as many as
    sampling gives, which is none in some runs: 2 of 8 rollout seeds measured), and on every response to the
    task's first question (the first group's, whatever is sampled: so every run meets failures)."""
    return response[:1].islower() or prompt == first_question()


def raise_on_some_responses(prompt, response, answer):
    if fails_on(prompt, response):
        raise ValueError("cannot score this response")
    return _digits(response)


def hang_on_some_responses(prompt, response, answer):
    """Hangs (far past the timeout) where the other one raises."""
    if fails_on(prompt, response):
        time.sleep(30)
    return _digits(response)


def always_raise(prompt, response, answer):
    raise RuntimeError("broken reward")


def hang_on_even_prompt(prompt, response, answer):
    """Hangs (far past the timeout) on the questions whose prompt's bytes have an even sum."""
    if sum(prompt.encode()) % 2 == 0:
        time.sleep(30)
    return 1.0


def raise_on_even_prompt(prompt, response, answer):
    """Fails on the questions whose prompt's bytes have an even sum, whatever the response."""
    if sum(prompt.encode()) % 2 == 0:
        raise ValueError(f"even prompt {prompt!r}")
    return 1.0


def constant_on_even_prompt(prompt, response, answer):
    """1 on the questions whose prompt's bytes have an even sum (a group there always agrees), else the dense
    mean-character-code reward (its samples almost never tie)."""
    if sum(prompt.encode()) % 2 == 0:
        return 1.0
    return _mean_char_code(response)


def mean_char_code(prompt, response, answer):
    """A dense reward (the response's mean character code, in [0, 1]): samples of a group almost never tie,
    so every group has nonzero advantages and every step a real update."""
    return _mean_char_code(response)


def varied_reward(prompt, response, answer):
    """A reward that differs between the members of a group (a function of the response bytes), so every
    update has non-zero advantages and changes the policy: versions differ, and a sample regenerated on the
    wrong version would show it."""
    return sum(response.encode()) % 10 / 10


def late_long_reward(prompt, response, answer):
    """:func:`varied_reward`, answered half a second late for a response of 32 bytes or more (the long tail's
    longest): a run that checkpoints in the loop trip in which such a sample decoded its last token does so with
    its reward still out, however quickly the workers would have answered."""
    if len(response.encode()) >= 32:
        time.sleep(0.5)
    return varied_reward(prompt, response, answer)


def spread_reward(prompt, response, answer):
    """A reward that differs between a group's responses, however short (the tiny model's are often one
    token), so that every update moves the policy."""
    return sum(map(ord, response)) % 7 / 6


def reward_refused_on_process_1(prompt, response, answer):
    """A reward that fails on process 1 only: its ledger filters what process 0's finishes. Rewards run in worker
    processes that never join the cluster, so the process is read from the launch's DORA_PROCESS_ID."""
    if os.environ.get("DORA_PROCESS_ID") == "1":
        raise ValueError("refused on process 1")
    return sum(c.isdigit() for c in response) / max(len(response), 1)
