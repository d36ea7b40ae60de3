"""Held-out accuracy outside a training run (``dora-jax eval``): of any weights, or of a run's newest checkpoint.

Both decode with the rollout engine a run of the same config uses and score with
:func:`~dora_jax.run.evaluation.evaluate`: ``task.eval_size`` questions, ``task.eval_samples`` answers each
(pass@k with k = ``task.eval_samples``) at ``task.eval_temperature``. One process, on the devices of
``cfg.mesh``.
"""

from __future__ import annotations

import os
from typing import Any

from dora_jax.config import Config, load_config
from dora_jax.run.evaluation import RunError, evaluate


def _evaluate_model(cfg: Config, model: Any, tokenizer: Any, mesh: Any, params: Any, version: int) -> dict[str, Any]:
    from dora_jax.run.placement import make_engine
    from dora_jax.run.setup import byte_tokenizer
    from dora_jax.tasks import load_task
    from dora_jax.tokenizer import chat_template_head

    task = load_task(cfg.task)
    tokenizer = tokenizer or byte_tokenizer(cfg)
    engine = make_engine(cfg, model, mesh)
    head = chat_template_head(tokenizer) if cfg.rollout.shared_prefix else []  # as a run prefills it
    shared = tuple(head) if 0 < len(head) < engine.max_prefill_length else ()
    result = evaluate(cfg, task, engine, tokenizer, engine.params if params is None else params, version, shared)
    return {"task": task.name, **result}


def evaluate_weights(cfg: Config, *, progress: bool = True) -> dict[str, Any]:
    """Held-out accuracy of ``cfg.model``'s weights (``model.weights``; a random init when empty) on
    ``cfg.task``.

    Returns:
      :func:`~dora_jax.run.evaluation.evaluate`'s result with ``task`` and ``weights``.
    """
    from dora_jax.models.weights import load_model
    from dora_jax.sharding import create_mesh

    mesh = create_mesh(cfg.mesh)
    model, tokenizer = load_model(cfg.model, mesh, cfg.mesh.logical_axis_rules, seed=cfg.run.seed,
                                  progress=progress)
    return {"weights": cfg.model.weights or "random init",
            **_evaluate_model(cfg, model, tokenizer, mesh, None, 0)}


def run_config(run_dir: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The config a run directory was trained with (its ``config.json``), with ``overrides`` applied (the task
    and evaluation settings, say).

    Raises:
      RunError: ``run_dir`` is not a run directory (no ``config.json``).
      ConfigError: a bad override, or a ``config.json`` this version cannot read, naming the field.
    """
    path = os.path.join(run_dir, "config.json")
    if not os.path.isdir(run_dir):
        raise RunError(f"--checkpoint {run_dir}: no such run directory")
    if not os.path.isfile(path):
        raise RunError(f"--checkpoint {run_dir}: no config.json there, so it is not a dora-jax run directory")
    return load_config(path, overrides)


def evaluate_checkpoint(run_dir: str, overrides: list[str] | tuple[str, ...] = (), *,
                        progress: bool = True) -> dict[str, Any]:
    """Held-out accuracy of the policy in ``run_dir``'s newest usable run checkpoint, with the run's config
    (``overrides`` applied for the evaluation; what the checkpoint holds must still restore).

    Returns:
      :func:`~dora_jax.run.evaluation.evaluate`'s result with ``task``, ``checkpoint`` (its path) and
      ``version`` (the policy version it holds).

    Raises:
      RunError: not a run directory, or no checkpoint in it (``run.checkpoint_every`` 0).
      CheckpointError: checkpoints that cannot be used, each with its reason.
    """
    from dora_jax.models.weights import load_model
    from dora_jax.run.checkpoint import RunCheckpoints
    from dora_jax.run.resume import run_fingerprint
    from dora_jax.sharding import create_mesh
    from dora_jax.trainer import Trainer

    saved, cfg = run_config(run_dir), run_config(run_dir, overrides)
    checkpoints = RunCheckpoints(os.path.join(run_dir, "checkpoints"), fingerprint=run_fingerprint(saved))
    if not checkpoints.steps():
        raise RunError(f"--checkpoint {run_dir}: no run checkpoint in {checkpoints.directory} (the run wrote none "
                       f"yet, or ran with run.checkpoint_every = 0)")
    mesh = create_mesh(cfg.mesh)
    model, tokenizer = load_model(cfg.model, mesh, cfg.mesh.logical_axis_rules, seed=cfg.run.seed,
                                  progress=progress)
    trainer, state = Trainer.create(cfg, model=model, mesh=mesh)  # the shapes and shardings to restore into
    found = checkpoints.restore_latest(target=state)
    params = trainer.policy_params(found.train_state)
    return {"checkpoint": str(found.path), **_evaluate_model(cfg, model, tokenizer, mesh, params, found.step),
            "version": found.step}
