"""Verifiable tasks: prompts with known answers and the reward functions that check responses.

A :class:`Task` is plain Python (no JAX): training items by index (the data position is one integer), a fixed
held-out set, and a ``score``. :func:`load_task` builds ``task.name`` (``arithmetic``, ``gsm8k``, ``math``,
``code``, ``longtail``, or ``"pkg.mod:make_task"``: a callable taking the :class:`TaskConfig`), with
``task.reward`` (``math``, or ``"pkg.mod:reward"``: ``reward(prompt, response, answer) -> float``) replacing
its reward. Rewards run in worker processes (:mod:`dora_jax.rewards`), so tasks and reward functions must be
picklable (module level, importable). docs/runner.md, "Tasks".
"""

from __future__ import annotations

import importlib
import traceback
from typing import Callable

from dora_jax.config import ConfigError, TaskConfig
from dora_jax.sandbox import Limits
from dora_jax.tasks.base import Item, Score, Task, last_number
from dora_jax.tasks.arithmetic import ArithmeticTask
from dora_jax.tasks.code import CodeTask
from dora_jax.tasks.data import TaskDataError
from dora_jax.tasks.gsm8k import GSM8KTask, JsonlTask
from dora_jax.tasks.math import MathTask, math_reward
from dora_jax.tasks.synthetic import LongTailTask

__all__ = ["ArithmeticTask", "CodeTask", "GSM8KTask", "Item", "JsonlTask", "LongTailTask", "MathTask", "Score", "Task",
           "TaskDataError", "import_object", "last_number", "load_task", "math_reward"]


def _describe(e: BaseException) -> str:
    """``Type: message (at file:line)``, the line being the innermost frame of the traceback."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{type(e).__name__}: {e.msg} (at {e.filename}:{e.lineno})"
    frames = traceback.extract_tb(e.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(e).__name__}: {e}{at}"


def import_object(path: str, where: str) -> Callable:
    """``"package.module:attribute"`` -> the attribute, with an error naming ``where`` the path came from."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{where}: {path!r} is not an import path; expected 'package.module:attribute'")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{where}: cannot import module {module!r} ({e})") from e
    except Exception as e:  # the module's own code failed while importing: name it, its file and line
        raise ConfigError(f"{where}: importing module {module!r} failed: {_describe(e)}") from e
    if not hasattr(mod, attr):
        raise ConfigError(f"{where}: module {module!r} has no attribute {attr!r}")
    obj = getattr(mod, attr)
    if not callable(obj):
        raise ConfigError(f"{where}: {path!r} is not callable")
    return obj


class _CustomReward(Task):
    """A task whose reward comes from a user function; everything else from the wrapped task."""

    def __init__(self, task: Task, fn: Callable[[str, str, str], float], path: str):
        self.task, self.fn, self.path = task, fn, path
        self.name = f"{task.name}+{path}"

    def train_item(self, index: int) -> Item:
        return self.task.train_item(index)

    def eval_items(self) -> list[Item]:
        return self.task.eval_items()

    def score(self, item: Item, response: str) -> Score:
        reward = self.fn(item.prompt, response, item.answer)
        return Score(float(reward), float(reward) > 0 and self.task.score(item, response).correct)


def load_task(cfg: TaskConfig) -> Task:
    """The task ``cfg.name`` names, with ``cfg.reward`` applied when set."""
    if cfg.name == "arithmetic":
        task: Task = ArithmeticTask(seed=cfg.seed, eval_size=cfg.eval_size, levels=cfg.levels)
    elif cfg.name == "longtail":
        task = LongTailTask(seed=cfg.seed, eval_size=cfg.eval_size, max_len=cfg.longtail_max_len)
    elif cfg.name in ("gsm8k", "math"):
        task = (GSM8KTask if cfg.name == "gsm8k" else MathTask)(
            cfg.path, eval_size=cfg.eval_size, seed=cfg.seed, prompt_field=cfg.prompt_field,
            answer_field=cfg.answer_field, split=cfg.split, subset=cfg.subset)
    elif cfg.name == "code":
        limits = Limits(timeout_s=cfg.code_timeout_s, memory_mb=cfg.code_memory_mb,
                        output_bytes=cfg.code_output_kb << 10)
        task = CodeTask(cfg.path, eval_size=cfg.eval_size, seed=cfg.seed, prompt_field=cfg.prompt_field,
                        tests_field=cfg.answer_field, split=cfg.split, subset=cfg.subset, limits=limits,
                        python=cfg.code_python)
    else:
        factory = import_object(cfg.name, "task.name")
        try:
            task = factory(cfg)
        except Exception as e:  # user code: say whose call failed instead of a bare traceback
            raise ConfigError(f"task.name: {cfg.name!r} raised {_describe(e)}") from e
        if not isinstance(task, Task):
            raise ConfigError(f"task.name: {cfg.name!r} returned {type(task).__name__}, not a dora_jax.tasks.Task")
    if cfg.reward == "math":
        task = _CustomReward(task, math_reward, "math")
    elif cfg.reward:
        task = _CustomReward(task, import_object(cfg.reward, "task.reward"), cfg.reward)
    return task
