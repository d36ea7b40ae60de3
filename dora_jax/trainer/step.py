"""The train step: a pure function ``(TrainState, TrainBatch) -> (TrainState, metrics)``.

:func:`make_train_step` returns it unjitted; :class:`Trainer` jits it with explicit shardings and a donated
state, with the forward passes the loop needs (policy params, recomputed behaviour and reference log-probs).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dora_jax.config import Config, ConfigError, TrainConfig
from dora_jax.sharding import Rules, activate, constrain, logical_to_spec, mesh_axes, serial_jit
from dora_jax.trainer import lora as lora_lib
from dora_jax.trainer.batch import BatchError, TrainBatch, bucket_rows, check_batch
from dora_jax.models.decoder import TrainSettings, head_logits
from dora_jax.trainer.losses import (LossTerms, chunked_token_logprobs, group_advantages, normalizers, policy_loss,
                                     staleness)
from dora_jax.trainer import packing as packing_lib
from dora_jax.trainer.packing import Packing, pack_tokens, padding_fraction, unpack
from dora_jax.trainer.state import TrainState, learning_rate_schedule, make_optimizer


def sequence_logprobs(graphdef: nnx.GraphDef, params: nnx.State, tokens_bt: jax.Array,
                      segment_ids_bt: jax.Array, lora: lora_lib.LoraParams | None = None,
                      lora_scale: float = 1.0, temperature: float = 1.0, *,
                      settings: TrainSettings = TrainSettings(), logprob_chunk: int = 0,
                      positions_bt: jax.Array | None = None) -> jax.Array:
    """The training forward's log-prob of every token given its prefix at the rollout's ``temperature``,
    [B, T] float32 (column 0 is 0). ``settings``: :class:`~dora_jax.models.decoder.TrainSettings`;
    ``logprob_chunk`` > 0: head and log-softmax over that many positions at a time. ``positions_bt``: rotary
    positions (default ``0..T-1`` in every row)."""
    b, t = tokens_bt.shape
    positions = positions_bt
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    model = nnx.merge(graphdef, params)
    hidden = model(tokens_bt, positions, segment_ids_bt, lora=lora, lora_scale=lora_scale, settings=settings,
                   hidden=True)
    head = model.head_params()
    return chunked_token_logprobs(hidden, lambda h: head_logits(model.cfg, head, h), tokens_bt, temperature,
                                  logprob_chunk)


def packed_sequence_logprobs(graphdef: nnx.GraphDef, params: nnx.State, tokens_nt: jax.Array, packing: Packing,
                             lora: lora_lib.LoraParams | None = None, lora_scale: float = 1.0,
                             temperature: float = 1.0, **forward: Any) -> jax.Array:
    """:func:`sequence_logprobs` of the batch layout's rows [N, T], run on the packed rows of ``packing``
    (:mod:`dora_jax.trainer.packing`) and returned in the batch layout: a sample's log-probs are its unpacked
    ones up to float rounding (0 at its position 0 and past its length)."""
    logp = sequence_logprobs(graphdef, params, pack_tokens(tokens_nt, packing), packing.segment_ids, lora,
                             lora_scale, temperature, positions_bt=packing.positions, **forward)
    return unpack(logp, packing, tokens_nt.shape[1])


def check_train_forward(cfg: TrainConfig, devices) -> None:
    """Raises ConfigError (naming the field, the value and what to use instead) for a training forward that
    ``devices`` cannot run: a platform kernel on another platform, or ``train.remat: offload`` without a
    pinned host memory."""
    from dora_jax.models.attention import unsupported_reason

    platform = devices[0].platform
    reason = unsupported_reason(cfg.attention_impl, platform)
    if reason:
        raise ConfigError(f"config field 'train.attention_impl' = {cfg.attention_impl!r}: {reason}",
                          field="train.attention_impl")
    if cfg.remat == "offload":
        kinds = {m.kind for d in devices for m in d.addressable_memories()}
        if "pinned_host" not in kinds:
            raise ConfigError(f"config field 'train.remat' = 'offload': the {platform} devices have no pinned "
                              f"host memory to offload to (memories: {', '.join(sorted(kinds))}); use 'dots' or "
                              "'full'", field="train.remat")


def policy_params(state: TrainState, cfg: TrainConfig) -> nnx.State:
    """The full model parameters of the state's policy (adapters folded in under LoRA)."""
    if cfg.lora.rank > 0:
        return lora_lib.merge(state.frozen, state.params, cfg.lora)
    return state.params


def _tree_add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def make_train_step(graphdef: nnx.GraphDef, cfg: TrainConfig, tx: optax.GradientTransformation,
                    temperature: float = 1.0, use_prox: bool = False
                    ) -> Callable[..., tuple[TrainState, dict]]:
    """One pure optimizer update for ``cfg``: advantages, staleness mask, micro-batched gradient, guarded update.

    The step is ``step(state, batch, packing=None)``. The gradient is summed over ``cfg.micro_batches``
    micro-batches (the packed ones with a :class:`~dora_jax.trainer.packing.Packing`) and equals the one-batch
    gradient. A non-finite loss or gradient leaves params and optimizer state as they were (metric ``skipped``
    = 1). The version is not advanced here (:meth:`Trainer.train_step` does). ``use_prox``: the proximal
    log-probs are the batch's ``prox_logprobs``; otherwise the current policy's.
    """
    schedule = learning_rate_schedule(cfg)
    forward = dict(settings=TrainSettings.of(cfg), logprob_chunk=cfg.logprob_chunk)

    def step(state: TrainState, batch: TrainBatch, packing: Packing | None = None
             ) -> tuple[TrainState, dict[str, jax.Array]]:
        rows, keep, stale, norms = _loss_rows(state, batch, cfg)
        micro = _micro_batches(rows, packing, cfg.micro_batches)
        loss_fn = functools.partial(_micro_batch_loss, graphdef, cfg, state.frozen, rows, packing, norms,
                                    temperature, use_prox, forward)
        grads, terms = _summed_gradients(loss_fn, state.params, micro)
        new_state, grad_norm, finite = _guarded_update(tx, state, grads, terms)
        metrics = _step_metrics(cfg, schedule, state, batch, packing, terms, keep, stale, grad_norm, finite)
        return new_state, metrics

    return step


def _loss_rows(state: TrainState, batch: TrainBatch, cfg: TrainConfig
               ) -> tuple[tuple[jax.Array, ...], jax.Array, jax.Array, Any]:
    """The per-row arrays the loss reads (tokens, segment ids, loss mask, behaviour, reference and proximal
    log-probs, advantages, kept), the staleness mask's ``keep`` and ``stale``, and the whole batch's loss
    normalizers."""
    valid = batch.valid
    keep, stale = staleness(batch.versions, valid, state.version, cfg.max_staleness)
    adv = group_advantages(batch.rewards, batch.group_ids, valid, cfg.advantage, cfg.std_eps)
    behaviour = batch.recomputed_logprobs if cfg.behaviour_logprobs == "recompute" else batch.behaviour_logprobs
    norms = normalizers(batch.loss_mask, keep, valid, cfg.max_response_tokens)
    rows = (batch.tokens, batch.segment_ids, batch.loss_mask, behaviour, batch.ref_logprobs, batch.prox_logprobs,
            adv, keep)
    return rows, keep, stale, norms


def _micro_batches(rows: tuple[jax.Array, ...], packing: Packing | None, n_micro: int) -> Any:
    """What the gradient scan runs over: the rows split into ``n_micro`` equal micro-batches, or the packed
    micro-batches of ``packing`` (each of which takes the update's rows whole)."""
    def split(x):
        x = x.reshape(n_micro, x.shape[0] // n_micro, *x.shape[1:])
        return constrain(x, (None, "batch") + (None,) * (x.ndim - 2))

    if packing is None:
        return jax.tree.map(split, rows)
    return jax.tree.map(lambda x: constrain(x, (None, "batch") + (None,) * (x.ndim - 2)), packing)


def _micro_batch_loss(graphdef: nnx.GraphDef, cfg: TrainConfig, frozen: nnx.State | None,
                      rows: tuple[jax.Array, ...], packing: Packing | None, norms: Any, temperature: float,
                      use_prox: bool, forward: dict[str, Any], trainable: nnx.State, mb: Any
                      ) -> tuple[jax.Array, LossTerms]:
    """One micro-batch's loss and its terms, as a function of the trainable params (the last two arguments;
    the rest are bound): under LoRA the adapters over the ``frozen`` base, otherwise the model's params."""
    if cfg.lora.rank > 0:
        params, adapters = frozen, (trainable, cfg.lora.alpha / cfg.lora.rank)
    else:
        params, adapters = trainable, (None, 1.0)
    if packing is None:
        tokens, seg, mask, beh, ref, prox, a, k = mb
        logp = sequence_logprobs(graphdef, params, tokens, seg, *adapters, temperature, **forward)
    else:
        tokens, seg, mask, beh, ref, prox, a, k = rows
        logp = packed_sequence_logprobs(graphdef, params, tokens, mb, *adapters, temperature, **forward)
        k = k & (mb.length > 0)  # this micro-batch's samples: each sample's terms in exactly one
    terms = policy_loss(logp, beh, ref, mask, a, k, norms, cfg, prox if use_prox else None)
    return terms.loss, terms


def _summed_gradients(loss_fn: Callable[[nnx.State, Any], tuple[jax.Array, LossTerms]], params: nnx.State,
                      micro: Any) -> tuple[nnx.State, LossTerms]:
    """The gradient of ``loss_fn`` at ``params`` and its terms, each summed over the micro-batches in a
    ``lax.scan``."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def accumulate(carry, mb):
        grads, terms = carry
        (_, t), g = grad_fn(params, mb)
        return (_tree_add(grads, g), _tree_add(terms, t)), None

    zero_terms = LossTerms(*([jnp.zeros((), jnp.float32)] * len(LossTerms._fields)))
    init = (jax.tree.map(jnp.zeros_like, params), zero_terms)
    (grads, terms), _ = jax.lax.scan(accumulate, init, micro)
    return grads, terms


def _guarded_update(tx: optax.GradientTransformation, state: TrainState, grads: nnx.State, terms: LossTerms
                    ) -> tuple[TrainState, jax.Array, jax.Array]:
    """The state after one optimizer update, with params and optimizer state left as they were where the
    loss or gradient is not finite; also the gradient norm and whether the update applied."""
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(terms.loss)
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)

    def pick(new, old):
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

    new_state = state.replace(
        step=state.step + 1,
        params=pick(new_params, state.params),
        opt_state=pick(new_opt, state.opt_state),
        rng=jax.random.split(state.rng)[0],
    )
    return new_state, grad_norm, finite


def _step_metrics(cfg: TrainConfig, schedule: optax.Schedule, state: TrainState, batch: TrainBatch,
                  packing: Packing | None, terms: LossTerms, keep: jax.Array, stale: jax.Array,
                  grad_norm: jax.Array, finite: jax.Array) -> dict[str, jax.Array]:
    """An update's metrics; ``state`` is the one the update started from."""
    valid = batch.valid
    f32 = jnp.float32
    kept_tokens = jnp.maximum((batch.loss_mask * keep[:, None]).sum(), 1.0)
    resp = batch.loss_mask * keep[:, None]
    valid_f = valid.astype(f32)
    metrics = {
        "loss": terms.loss, "pg_loss": terms.pg_loss, "kl": terms.kl,
        "grad_norm": grad_norm, "skipped": (~finite).astype(f32),
        "learning_rate": schedule(state.step),
        "samples": valid_f.sum(), "kept_samples": keep.astype(f32).sum(), "stale_samples": stale.astype(f32).sum(),
        "kept_tokens": (batch.loss_mask * keep[:, None]).sum(),
        "clip_frac": terms.clipped_tokens / kept_tokens,
        "is_weight_mean": terms.is_weight_sum / kept_tokens,
        "is_dropped_frac": terms.is_dropped_tokens / kept_tokens,
        "reward_mean": (batch.rewards * valid_f).sum() / jnp.maximum(valid_f.sum(), 1.0),
        "lag_mean": ((state.version - batch.versions) * valid_f).sum() / jnp.maximum(valid_f.sum(), 1.0),
        "version": state.version.astype(f32),
        # The rows the forward ran on: the batch's, or the packed ones.
        "rows": jnp.asarray(batch.tokens.shape[0] if packing is None
                            else packing.source.shape[0] * packing.source.shape[1], f32),
        "padding_frac": padding_fraction(batch.segment_ids, valid) if packing is None
        else padding_fraction(packing.segment_ids),
    }
    if cfg.behaviour_logprobs == "recompute" or cfg.correction == "decoupled":
        # The engine's log-probs against the training forward of each sample's own version: only where the
        # run recomputes them (otherwise the recomputed field holds nothing to compare with).
        gap = jnp.abs(batch.behaviour_logprobs - batch.recomputed_logprobs) * resp
        metrics.update(logprob_gap_mean=gap.sum() / kept_tokens, logprob_gap_max=gap.max())
    return metrics


def minibatch_rows(group_ids: np.ndarray, valid: np.ndarray, minibatches: int, epochs: int,
                   rng: np.random.Generator, row_multiple: int) -> list[Any]:
    """Each update's rows, ``(rows, real, group_ids)`` index arrays of whole groups, ``minibatches`` to an epoch,
    the groups shuffled per epoch; row counts bucketed like a batch's (padding rows repeat row 0, ``real``
    False)."""
    groups = sorted(set(group_ids[valid].tolist()))
    if len(groups) % minibatches:
        raise BatchError(f"the batch has {len(groups)} groups, which train.minibatches = {minibatches} does not "
                         "divide: every update takes whole groups")
    members = {g: np.flatnonzero(valid & (group_ids == g)) for g in groups}
    per = len(groups) // minibatches
    n = bucket_rows(sum(len(members[g]) for g in groups[:per]), row_multiple)
    plan = []
    for _ in range(epochs):
        order = rng.permutation(len(groups))
        for j in range(minibatches):
            chosen = [groups[i] for i in order[j * per:(j + 1) * per]]
            rows = np.concatenate([members[g] for g in chosen])
            if len(rows) > n:
                raise BatchError(f"a minibatch of {len(rows)} rows exceeds {n}: groups differ in size")
            idx, real, gid = np.zeros(n, np.int32), np.zeros(n, bool), np.zeros(n, np.int32)
            idx[:len(rows)], real[:len(rows)] = rows, True
            gid[:len(rows)] = np.concatenate([np.full(len(members[g]), k) for k, g in enumerate(chosen)])
            plan.append((idx, real, gid))
    return plan


def _host(x: jax.Array) -> np.ndarray:
    """A small per-row array on the host (gathered from every process when it spans several)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _take_rows(batch: TrainBatch, rows: jax.Array, real: jax.Array, group_ids: jax.Array) -> TrainBatch:
    """The minibatch of ``batch``'s ``rows``, group ids renumbered from 0 and padding rows made invalid."""
    picked = jax.tree.map(lambda x: x[rows], batch)
    return picked.replace(group_ids=group_ids, valid=picked.valid & real)


_SPREAD = ("clip_frac", "is_weight_mean")


def _finish_iteration(state: TrainState, history: list[dict[str, jax.Array]]
                      ) -> tuple[TrainState, dict[str, jax.Array]]:
    """Advances the version once if any update applied; the iteration's metrics from its updates'."""
    stacked = {k: jnp.stack([m[k] for m in history]) for k in history[0]}
    skipped = stacked["skipped"].sum()
    applied = len(history) - skipped
    metrics = {k: v.mean() for k, v in stacked.items()}
    metrics.update(skipped=skipped, applied=applied, updates=jnp.asarray(len(history), jnp.float32),
                   learning_rate=stacked["learning_rate"][-1], version=stacked["version"][0])
    for k in _SPREAD:
        metrics[f"{k}_min"], metrics[f"{k}_max"] = stacked[k].min(), stacked[k].max()
    return state.replace(version=state.version + (applied > 0).astype(jnp.int32)), metrics


class Trainer:
    """The static half of training: config, graph definition, optimizer, mesh, and the jitted functions.

    Typical use::

        trainer, state = Trainer.create(cfg)
        batch = trainer.put(make_batch(samples, group_size=..., length_buckets=...,
                                       row_multiple=trainer.row_multiple))
        state, metrics = trainer.train_step(state, batch)
    """

    def __init__(self, cfg: Config, graphdef: nnx.GraphDef, mesh: Mesh, rules: Rules,
                 state_shardings: Any, reference: nnx.State | None = None,
                 tx: optax.GradientTransformation | None = None):
        self.cfg = cfg
        self.graphdef = graphdef
        self.mesh = mesh
        self.rules = rules
        self.tx = tx if tx is not None else make_optimizer(cfg.train)
        self.state_shardings = state_shardings
        self._reference = reference
        batch_axes = logical_to_spec(("batch",), rules)[0]
        self._row = NamedSharding(mesh, P(batch_axes))
        self._row_tok = NamedSharding(mesh, P(batch_axes, None))
        self.data_parallel = mesh_axes("batch", mesh, rules)[1]
        self.batch_shardings = TrainBatch(
            tokens=self._row_tok, segment_ids=self._row_tok, loss_mask=self._row_tok,
            behaviour_logprobs=self._row_tok, recomputed_logprobs=self._row_tok, ref_logprobs=self._row_tok,
            prox_logprobs=self._row_tok, versions=self._row, group_ids=self._row, rewards=self._row, valid=self._row)
        micro_row_tok = NamedSharding(mesh, P(None, batch_axes, None))  # [micro-batch, packed row, position]
        micro_row = NamedSharding(mesh, P(None, batch_axes))
        self.packing_shardings = Packing(source=micro_row_tok, segment_ids=micro_row_tok, positions=micro_row_tok,
                                         row=micro_row, offset=micro_row, length=micro_row)
        replicated = NamedSharding(mesh, P())
        t = cfg.train
        check_train_forward(t, list(mesh.devices.flat))
        # Every log-prob the trainer takes is under the distribution the rollout samples: logits / T.
        self.temperature = cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0
        self.updates_per_iteration = t.minibatches * t.epochs
        # Proximal log-probs are data only when an iteration has several updates; with one, the current policy
        # is the proximal one exactly (no second forward, no rounding between two programs).
        self._use_prox = t.correction != "none" and self.updates_per_iteration > 1
        step = make_train_step(graphdef, t, self.tx, self.temperature, self._use_prox)
        self._step = serial_jit(step, in_shardings=(state_shardings, self.batch_shardings),
                                out_shardings=(state_shardings, replicated), donate_argnums=(0,))
        self.packed = t.packing == "pack"
        self._packed_step = serial_jit(step, in_shardings=(state_shardings, self.batch_shardings,
                                                           self.packing_shardings),
                                       out_shardings=(state_shardings, replicated), donate_argnums=(0,))
        # A plan is host data every process computes alike; it enters the mesh through a program (as the
        # minibatch row indices do), not as numpy arguments of a sharded step.
        self._place_packing = serial_jit(lambda p: p, out_shardings=self.packing_shardings)
        self._lengths = serial_jit(lambda seg, valid: jnp.where(valid, (seg != 0).sum(1), 0).astype(jnp.int32),
                                   out_shardings=self._row)
        temperature = self.temperature
        forward = dict(settings=TrainSettings.of(t), logprob_chunk=t.logprob_chunk)
        self._logprobs = serial_jit(lambda p, tokens, seg: sequence_logprobs(graphdef, p, tokens, seg,
                                                                             temperature=temperature, **forward),
                                    out_shardings=self._row_tok)
        self._packed_logprobs = serial_jit(  # one packed micro-batch: all rows at once
            lambda p, tokens, pk: packed_sequence_logprobs(graphdef, p, tokens, jax.tree.map(lambda x: x[0], pk),
                                                           temperature=temperature, **forward),
            out_shardings=self._row_tok)
        self._policy = serial_jit(lambda s: policy_params(s, t))
        self._take = serial_jit(_take_rows, out_shardings=self.batch_shardings)
        self._place_index = serial_jit(lambda index: index, out_shardings=replicated)  # as _place_packing
        self._zero_rows = serial_jit(lambda tokens: jnp.zeros(tokens.shape, jnp.float32), out_shardings=self._row_tok)
        self._gather_rows = serial_jit(lambda tokens, seg, index: (tokens.at[index].get(mode="fill", fill_value=0),
                                                                   seg.at[index].get(mode="fill", fill_value=0)),
                                       out_shardings=(self._row_tok, self._row_tok))
        self._scatter_rows = serial_jit(lambda out, lp, index: out.at[index].set(lp, mode="drop"),
                                        out_shardings=self._row_tok)
        self._finish = serial_jit(_finish_iteration, out_shardings=(state_shardings, replicated),
                                  donate_argnums=(0,))

    # -- construction ---------------------------------------------------------------------------------------

    @classmethod
    def create(cls, cfg: Config, model: nnx.Module | None = None, mesh: Mesh | None = None,
               rules: Rules | None = None, tx: optax.GradientTransformation | None = None
               ) -> tuple["Trainer", TrainState]:
        """A trainer and its initial state, created in the mesh's shardings.

        Args:
          cfg: the whole config (``cfg.model`` builds or loads the model unless ``model`` is given).
          model: an already built model; its parameters become version 0, placed in ``mesh``'s shardings.
          mesh: default: the mesh of ``cfg.mesh`` over all devices.
          rules: default: ``cfg.mesh.logical_axis_rules``.
          tx: an optimizer to use instead of the one ``cfg.train`` describes.
        """
        from dora_jax.models.build import state_shardings
        from dora_jax.models.weights import load_model
        from dora_jax.sharding import create_mesh

        mesh = mesh if mesh is not None else create_mesh(cfg.mesh)
        rules = rules if rules is not None else cfg.mesh.logical_axis_rules
        if model is None:
            model, _ = load_model(cfg.model, mesh, rules, seed=cfg.run.seed, progress=False)
        graphdef, params = nnx.split(model)
        # The model may live elsewhere (one device, another mesh): its params move device to device into this
        # mesh's shardings, so that every array the trainer builds from them is on the trainer's devices.
        params = jax.device_put(params, state_shardings(params, mesh, rules))
        tcfg = cfg.train
        key = jax.random.key(cfg.run.seed)
        tx = tx if tx is not None else make_optimizer(tcfg)
        if tcfg.lora.rank > 0:
            replicated = NamedSharding(mesh, P())
            trainable = serial_jit(lambda k: lora_lib.init_lora(params, tcfg.lora, k),
                                       out_shardings=replicated)(jax.random.fold_in(key, 1))
            frozen, reference = params, None  # the base weights are the reference policy
        else:
            trainable, frozen = params, None
            reference = jax.tree.map(jnp.copy, params) if tcfg.kl_coef > 0 else None
        # Moments are born in their parameters' shardings (init's zeros_like does not propagate them: left to
        # the compiler they land on one device and would be replicated); counters are replicated.
        scalar = NamedSharding(mesh, P())
        param_shardings = jax.tree.map(lambda x: x.sharding, trainable)
        opt_shardings = optax.tree_map_params(tx, lambda _, sh: sh, jax.eval_shape(tx.init, trainable),
                                              param_shardings, transform_non_params=lambda _: scalar)
        opt_state = serial_jit(tx.init, out_shardings=opt_shardings)(trainable)
        state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), scalar),
                           version=jax.device_put(jnp.zeros((), jnp.int32), scalar),
                           params=trainable, frozen=frozen, opt_state=opt_state,
                           rng=jax.device_put(jax.random.key_data(jax.random.fold_in(key, 2)), scalar))
        shardings = jax.tree.map(lambda x: x.sharding, state)
        return cls(cfg, graphdef, mesh, rules, shardings, reference, tx), state

    # -- the step -------------------------------------------------------------------------------------------

    @property
    def row_multiple(self) -> int:
        """Batch rows must be a multiple of this: micro-batches x data-parallel devices."""
        return self.cfg.train.micro_batches * self.data_parallel

    def put(self, batch: TrainBatch) -> TrainBatch:
        """Checks a host batch and places it in the batch shardings; BatchError on wrong shapes or values, or
        a row count the mesh and micro-batches cannot split."""
        check_batch(batch)
        rows = np.shape(batch.tokens)[0]
        if rows % self.row_multiple:
            raise BatchError(f"batch has {rows} rows; it must be a multiple of {self.row_multiple} "
                             f"(train.micro_batches = {self.cfg.train.micro_batches} x data-parallel devices "
                             f"{self.data_parallel}); build it with make_batch(row_multiple=trainer.row_multiple)")
        return jax.device_put(batch, self.batch_shardings)

    def train_step(self, state: TrainState, batch: TrainBatch, iteration: int = 0
                   ) -> tuple[TrainState, dict[str, jax.Array]]:
        """One RL iteration on ``batch`` (whole groups): ``train.epochs`` passes, each split into
        ``train.minibatches`` optimizer updates of whole groups, shuffled per epoch from ``run.seed`` and
        ``iteration``; the version advances by one if at least one update applied. ``state`` is donated: use
        the returned one. Asynchronous: nothing here waits for the device.

        Returns:
          ``(state, metrics)``: every update's metric averaged over the iteration's updates, with ``updates``,
          ``skipped`` (non-finite updates left out), ``applied`` and the spread of ``clip_frac`` and
          ``is_weight_mean`` over the updates (``*_min``, ``*_max``).
        """
        t = self.cfg.train
        with activate(self.mesh, self.rules):
            lengths = _host(self._lengths(batch.segment_ids, batch.valid)) if self.packed else None
            if self._use_prox:  # the proximal policy: the weights at the iteration's start, for every update
                prox = self._forward(self._policy(state), batch.tokens, batch.segment_ids, lengths) * batch.loss_mask
                batch = batch.replace(prox_logprobs=prox)
            plan = [None] * t.epochs if t.minibatches == 1 else minibatch_rows(
                _host(batch.group_ids), _host(batch.valid), t.minibatches, t.epochs,
                np.random.default_rng([self.cfg.run.seed, iteration]), self.row_multiple)
            packs = (self._update_packings(lengths, int(batch.tokens.shape[1]), plan) if self.packed
                     else [None] * len(plan))
            history = []
            for rows, pk in zip(plan, packs):
                mb = batch if rows is None else self._take(batch, *rows)
                state, metrics = self._step(state, mb) if pk is None else self._packed_step(state, mb, pk)
                history.append(metrics)
            return self._finish(state, history)

    def _update_packings(self, lengths: np.ndarray, t: int, plan: list[Any]) -> list[Packing]:
        """Each update's packing (:func:`~dora_jax.trainer.packing.iteration_plan`) into rows of length ``t``."""
        per_update = [lengths if rows is None else lengths[rows[0]] * rows[1] for rows in plan]
        per_device = len(per_update[0]) // self.row_multiple  # rows of an unpacked micro-batch on a device
        plans = packing_lib.iteration_plan(per_update, t, self.data_parallel, per_device, self.cfg.train.micro_batches)
        return [self._place_packing(pk) for pk in plans]

    def _forward(self, params: nnx.State, tokens: jax.Array, seg: jax.Array, lengths: np.ndarray | None
                 ) -> jax.Array:
        """Log-probs [B, T] of the rows ``tokens``: packed when ``train.packing`` says so (``lengths``: each
        row's tokens, 0 for a row to leave out), in one run per data-parallel device."""
        if lengths is None:
            return self._logprobs(params, tokens, seg)
        t = tokens.shape[1]
        pk = self._place_packing(packing_lib.plan(lengths, t, self.data_parallel))
        return self._packed_logprobs(params, tokens, pk)

    # -- forwards around the step ------------------------------------------------------------------------------

    def policy_params(self, state: TrainState) -> nnx.State:
        """The full parameters of the state's policy, for the rollout engine and the version store."""
        return self._policy(state)

    def logprobs(self, params: nnx.State, batch: TrainBatch) -> jax.Array:
        """The log-probs [B, T] of ``params`` on the batch's rows (packed under ``train.packing: pack``: then 0
        at each sample's position 0 and past its length)."""
        with activate(self.mesh, self.rules):
            lengths = _host(self._lengths(batch.segment_ids, batch.valid)) if self.packed else None
            return self._forward(params, batch.tokens, batch.segment_ids, lengths)

    def with_recomputed_behaviour(self, batch: TrainBatch, params_of: Callable[[int], nnx.State] | Mapping[int, nnx.State],
                                  host: TrainBatch | None = None) -> TrainBatch:
        """The batch with ``recomputed_logprobs`` from the training forward on each row's own version;
        ``params_of(version)`` returns that version's full parameters (resident or restored).

        The rows stay on the devices: each version's rows are gathered there by index, run through the forward
        and put back, so only the row indices cross from the host. ``host``: the batch as numpy arrays
        (:func:`~dora_jax.trainer.batch.make_batch`'s output, which the caller already has); without it the
        per-row versions and validity are read back from the devices (a few bytes a row)."""
        get = params_of.__getitem__ if isinstance(params_of, Mapping) else params_of
        src = batch if host is None else host
        versions, valid = _host(src.versions), _host(src.valid).astype(bool)
        lengths = None
        if self.packed:  # each row's tokens, 0 for a row left out: what the packing plans
            lengths = (np.where(valid, (np.asarray(host.segment_ids) != 0).sum(1), 0).astype(np.int32)
                       if host is not None else _host(self._lengths(batch.segment_ids, batch.valid)))
        with activate(self.mesh, self.rules):
            out = self._zero_rows(batch.tokens)
            for v in np.unique(versions[valid]):
                rows = np.flatnonzero(valid & (versions == v))
                # Padded to the data-parallel bucket with an index past the last row: gathered as a zero row,
                # dropped when scattered back.
                index = np.full(bucket_rows(len(rows), self.data_parallel), len(versions), np.int32)
                index[:len(rows)] = rows
                index = self._place_index(index)
                tokens, seg_ids = self._gather_rows(batch.tokens, batch.segment_ids, index)
                sub_lengths = None
                if lengths is not None:
                    sub_lengths = np.zeros(len(index), np.int32)
                    sub_lengths[:len(rows)] = lengths[rows]
                out = self._scatter_rows(out, self._forward(get(int(v)), tokens, seg_ids, sub_lengths), index)
        return batch.replace(recomputed_logprobs=out * batch.loss_mask)

    def with_reference(self, state: TrainState, batch: TrainBatch) -> TrainBatch:
        """The batch with ``ref_logprobs`` from the reference policy (the initial weights; under LoRA, the
        frozen base)."""
        ref = state.frozen if self.cfg.train.lora.rank > 0 else self._reference
        if ref is None:
            raise ValueError("no reference policy is held: set train.kl_coef > 0 before Trainer.create")
        lp = self.logprobs(ref, batch) * batch.loss_mask
        return batch.replace(ref_logprobs=lp)
