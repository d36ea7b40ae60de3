"""``dora-jax check``: will this config fit its target hardware? Answered before renting the hardware.

On fake CPU devices, as many as ``target.num_devices``, it builds the abstract parameters (``jax.eval_shape``,
nothing allocated) and their shardings for the configured roles, lowers and compiles ahead of time the train
step (:func:`dora_jax.trainer.step.make_train_step` on an abstract TrainState and TrainBatch of the configured
shapes) and the rollout engine's decode step (on an abstract decode state), and reports per-device memory:
parameters, optimizer state, resident policy versions, KV cache, and the activations and scratch space XLA
plans for each step (``compiled.memory_analysis()``). It fails when the total exceeds ``target.memory_gib``.

JAX fixes the device count when it starts, so :func:`check_in_subprocess` runs the check in a fresh Python
with ``XLA_FLAGS=--xla_force_host_platform_device_count=N``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
from typing import Any, Callable

GIB = 2 ** 30


class CheckError(RuntimeError):
    """The config does not fit its target, or cannot be checked; the message says which part and by how much."""


@dataclasses.dataclass
class RoleMemory:
    """Bytes per device of one role. ``temp`` is XLA's scratch (activations) for the role's step; None when the
    step was lowered but not compiled."""

    name: str
    devices: int
    parts: dict[str, int]
    temp: int | None
    compiled_args: int | None = None
    notes: tuple[str, ...] = ()
    token_bytes: float = 0.0  # per device, of one token in the KV cache (the rollout's)
    version_bytes: int = 0  # per device, of one resident policy version (the rollout's)

    @property
    def total(self) -> int:
        return sum(self.parts.values()) + (self.temp or 0)


def per_device_bytes(tree: Any) -> int:
    """Bytes that the most loaded device holds of a tree of sharded ShapeDtypeStructs (or arrays)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def _with_shardings(abstract: Any, shardings: Any) -> Any:
    import jax

    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)  # noqa: E731
    leaves = jax.tree.leaves(shardings, is_leaf=is_sharding)
    flat, treedef = jax.tree.flatten(abstract)
    if len(flat) != len(leaves):
        raise AssertionError(f"{len(flat)} leaves but {len(leaves)} shardings")  # programming error
    return jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                        for x, s in zip(flat, leaves)])


def _compile(jitted: Callable, args: tuple, mesh: Any, rules: Any, do_compile: bool) -> tuple[int | None, int | None]:
    """Lowers (always) and compiles (if asked); returns XLA's (temp bytes, argument bytes) per device."""
    from dora_jax.sharding import activate

    with activate(mesh, rules):
        lowered = jitted.lower(*args)
    if not do_compile:
        return None, None
    stats = lowered.compile().memory_analysis()
    if stats is None:  # a backend without memory statistics
        return None, None
    return int(stats.temp_size_in_bytes), int(stats.argument_size_in_bytes)


def trainer_memory(cfg: Any, mesh: Any, do_compile: bool) -> RoleMemory:
    """Per-device memory of the trainer on ``mesh``: state, batch, and the compiled train step's scratch."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dora_jax.models.build import abstract_model, state_shardings
    from dora_jax.trainer import lora as lora_lib
    from dora_jax.trainer.batch import TrainBatch, bucket_length, bucket_rows
    from dora_jax.trainer.state import TrainState
    from dora_jax.trainer.step import Trainer, make_train_step

    from dora_jax.models.attention import resolve_train_attention, unsupported_reason

    rules = cfg.mesh.logical_axis_rules
    graphdef, abstract = abstract_model(cfg.model)
    params = _with_shardings(abstract, state_shardings(abstract, mesh, rules))
    replicated = NamedSharding(mesh, P())
    tcfg = cfg.train
    r = cfg.rollout
    t = bucket_length(r.max_prompt_len + r.max_new_tokens, tcfg.length_buckets)
    impl = resolve_train_attention(tcfg.attention_impl, t, tcfg.attention_block)
    attention = impl
    if unsupported_reason(impl, jax.default_backend()):
        # A platform kernel does not compile for the CPU devices the check runs on: its activations are counted
        # with the portable blockwise attention, which keeps the same residuals (q, k, v, output, log-sum-exp).
        tcfg = dataclasses.replace(tcfg, attention_impl="blockwise")
        attention = f"{impl} on the target, counted here as blockwise"
        cfg = dataclasses.replace(cfg, train=tcfg)
    if tcfg.lora.rank > 0:
        lora_abs = jax.eval_shape(lambda k: lora_lib.init_lora(params, tcfg.lora, k), jax.random.key(0))
        trainable, frozen = _with_shardings(lora_abs, jax.tree.map(lambda _: replicated, lora_abs)), params
    else:
        trainable, frozen = params, None
    trainer = Trainer(cfg, graphdef, mesh, rules, state_shardings=None)
    tx = trainer.tx
    opt_abs = jax.eval_shape(tx.init, trainable)
    trainable_sh = jax.tree.map(lambda x: x.sharding, trainable)
    opt_sh = optax.tree_map_params(tx, lambda _, s: s, opt_abs, trainable_sh,
                                   transform_non_params=lambda _: replicated,
                                   is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    opt = _with_shardings(opt_abs, opt_sh)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    rng = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    state = TrainState(step=scalar, version=scalar, params=trainable, frozen=frozen, opt_state=opt,
                       rng=jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=replicated))
    state_sh = jax.tree.map(lambda x: x.sharding, state)

    b = bucket_rows(cfg.dora.train_batch // tcfg.minibatches, trainer.row_multiple)  # one optimizer update's rows
    f32, i32 = jnp.float32, jnp.int32
    shapes = dict(tokens=((b, t), i32), segment_ids=((b, t), i32), loss_mask=((b, t), f32),
                  behaviour_logprobs=((b, t), f32), recomputed_logprobs=((b, t), f32), ref_logprobs=((b, t), f32),
                  prox_logprobs=((b, t), f32),
                  versions=((b,), i32), group_ids=((b,), i32), rewards=((b,), f32), valid=((b,), jnp.bool_))
    batch = TrainBatch(**{k: jax.ShapeDtypeStruct(s, d, sharding=getattr(trainer.batch_shardings, k))
                          for k, (s, d) in shapes.items()})
    step = jax.jit(make_train_step(graphdef, tcfg, tx), in_shardings=(state_sh, trainer.batch_shardings),
                   out_shardings=(state_sh, replicated), donate_argnums=(0,))
    temp, args = _compile(step, (state, batch), mesh, rules, do_compile)
    parts = {"params": per_device_bytes(params if frozen is None else (trainable, frozen)),
             "optimizer": per_device_bytes(opt), "batch": per_device_bytes(batch)}
    if tcfg.kl_coef > 0 and tcfg.lora.rank == 0:
        parts["reference"] = per_device_bytes(params)
    m = cfg.model
    forward = (f"train step: {b} rows of {t} tokens per update ({b // tcfg.micro_batches} per micro-batch, "
               f"{max(b // tcfg.micro_batches // trainer.data_parallel, 1)} per device); {m.param_dtype} weights, "
               f"{m.compute_dtype} compute; remat {tcfg.remat}, attention {attention} (blocks of "
               f"{min(tcfg.attention_block, t)}), log-probs "
               + (f"in chunks of {tcfg.logprob_chunk}" if 0 < tcfg.logprob_chunk < t else "unchunked"))
    return RoleMemory("trainer", mesh.size, parts, temp, args, notes=(forward,))


def rollout_memory(cfg: Any, mesh: Any, do_compile: bool) -> RoleMemory:
    """Per-device memory of one rollout group on ``mesh``: resident versions, KV cache, decode-step scratch.

    ``train.max_staleness + 1`` policy versions can be resident at once (DORA's bound; one under
    ``roles.versions_per_group: 1``), each a full copy of the parameters in ``rollout.dtype`` and the rollout
    shardings; the KV cache is in ``rollout.dtype`` too.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dora_jax.models.build import state_shardings
    from dora_jax.models.decoder import Decoder, DecodeSettings
    from dora_jax.rollout.engine import Engine, bucket
    from dora_jax.run.placement import kv_pages

    rules = cfg.mesh.logical_axis_rules
    model = nnx.eval_shape(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)))
    r = cfg.rollout
    engine = Engine(model, max_concurrent_decodes=r.slots, max_prefill_length=r.max_prompt_len,
                    max_target_length=min(bucket(r.max_prompt_len + r.max_new_tokens), cfg.model.max_seq_len),
                    mesh=mesh, dtype=r.dtype, settings=DecodeSettings.of(r), page_tokens=r.page_tokens,
                    num_pages=kv_pages(cfg))
    params = _with_shardings(engine.params, state_shardings(engine.params, mesh, rules))
    # A resident version is held in the rollout dtype (Engine.prepare_params casts it once per version).
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, engine.dtype, sharding=x.sharding), params)
    decode = jax.eval_shape(lambda: engine.programs.zeros(r.slots))
    replicated = NamedSharding(mesh, P())
    decode = _with_shardings(decode, jax.tree.map(lambda _: replicated, decode))  # per-slot vectors are tiny
    # The page pool in the engine's own layout (DecodePrograms.pool_layout).
    pool = engine.pool_shape()
    pool = _with_shardings(pool, engine.programs.pool_layout(pool))
    # Every slot's table at its longest: the step that reads the most.
    tables = jax.ShapeDtypeStruct((r.slots, engine.table_width), jnp.int32, sharding=replicated)

    # The engine's decode step traced on abstract arguments: exactly what a rollout runs per step.
    def decode_step(p, state, pool, tables):
        every = jnp.ones(state.tokens.shape, bool)  # every slot steps: none waits for pages
        return engine.programs.decode_step(engine.prepare_params(p), state, pool, tables, every, None)

    temp, args = _compile(jax.jit(decode_step, donate_argnums=(1, 2)), (params, decode, pool, tables), mesh, rules,
                          do_compile)
    # A group holds every live version, K + 1 at most (the design's promise), each in its decode layout; or one
    # under roles.versions_per_group 1, counting a group's old version dropped before its new one is loaded.
    versions = 1 if cfg.roles.versions_per_group == 1 else cfg.train.max_staleness + 1
    parts = {f"params x{versions} versions": versions * per_device_bytes(params),
             "kv cache": per_device_bytes(pool)}
    pool_tokens = pool.num_pages * pool.page_tokens
    # What the engine compiles at warm-up, before the first update (a run's shared prefix is the tokenizer's
    # chat-template head, unknown here: counted as one, its own program per length).
    from dora_jax.rollout.sampling import run_filters
    from dora_jax.rollout.warmup import program_catalog

    catalog = program_catalog(engine, versions=versions, filtered=run_filters(r.top_k, r.top_p),
                                     prefix_tokens=1 if r.shared_prefix else 0)
    kinds: dict[str, int] = {}
    for name, *_ in catalog:
        kinds[name] = kinds.get(name, 0) + 1
    note = (f"rollout engine: {len(catalog)} programs to compile at warm-up (rollout.warmup; "
            + ", ".join(f"{k} {v}" for k, v in kinds.items()) + ")")
    return RoleMemory("rollout", mesh.size, parts, temp, args, notes=(note,),
                      token_bytes=parts["kv cache"] / pool_tokens, version_bytes=per_device_bytes(params))


def with_elastic_group(cfg: Any, train: RoleMemory, mesh: Any, casts: bool, do_compile: bool) -> RoleMemory:
    """The trainer's memory with the elastic group's (``roles.elastic_group``) on its devices: the group's page pool
    beside the optimizer state for the whole run; its decode scratch, and its copy of the newest version where the
    rollout dtype ``casts`` one, only while it is lent, when no train step runs (the larger scratch counts)."""
    el = rollout_memory(cfg, mesh, do_compile)
    lent = (el.temp or 0) + (el.version_bytes if casts else 0)
    return RoleMemory("trainer + elastic group", train.devices,
                      {**train.parts, "elastic group kv cache": el.parts["kv cache"]},
                      None if train.temp is None else max(train.temp, lent), train.compiled_args, train.notes)


def group_layouts(cfg: Any, roll: RoleMemory, groups: int, rollout_devices: int) -> str:
    """The line comparing one policy version per rollout group with K + 1 (``train.max_staleness + 1``) versions per
    group, for a split placement: devices per group, groups, and a group device's weights under each, from the
    rollout's measured share of one version (``roll.version_bytes``). When ``target.memory_gib`` is set and K + 1
    versions per group would not fit it, it adds how many devices per group they would need.

    The needed count doubles the group's devices until the group's weights fit, up to every rollout device: weights
    shrink with the devices that shard them, while the KV cache and scratch are counted as at the present size (the
    KV heads shard only so far), so the count errs large.

    Args:
      cfg: the checked config.
      roll: the rollout's memory (:func:`rollout_memory`) on one group's mesh.
      groups: the rollout groups in the cluster.
      rollout_devices: the devices all rollout groups take together.
    """
    live = cfg.train.max_staleness + 1
    per_group, one = roll.devices, roll.version_bytes
    line = (f"rollout groups: {groups} of {per_group} devices; weights per device: {one / GIB:.1f} GiB at 1 version "
            f"per group, {live * one / GIB:.1f} GiB at K + 1 = {live} (roles.versions_per_group: "
            f"{cfg.roles.versions_per_group})")
    budget = cfg.target.memory_gib * GIB
    resident = 1 if cfg.roles.versions_per_group == 1 else live
    rest = roll.total - resident * one  # the KV cache and the step's scratch, kept as they are
    if not budget or rest + live * one <= budget:
        return line
    devices = per_group
    while devices < rollout_devices and rest + live * one * per_group / devices > budget:
        devices *= 2
    if rest + live * one * per_group / devices > budget or devices > rollout_devices:
        return line + (f"; K + 1 versions per group do not fit {cfg.target.memory_gib:g} GiB per device even in one "
                       f"group of all {rollout_devices} rollout devices")
    return line + (f"; K + 1 versions per group need {devices} devices per group to fit "
                   f"{cfg.target.memory_gib:g} GiB ({rollout_devices // devices} groups)")


def role_meshes_of_run(cfg: Any, processes: int = 1) -> tuple[Any, Any, bool]:
    """The trainer's mesh and one rollout engine's mesh as a run of ``cfg`` lays them out over this process's
    devices taken as ``processes`` hosts of equal device counts, in order (docs/scale.md: under several
    processes each decodes on its own devices, or with ``roles.rollout_span=all`` one engine spans them all), and
    whether the two roles share devices.

    Raises:
      ConfigError: naming the field (or ``--processes``) when the devices do not split that way.
    """
    import jax

    from dora_jax.config import ConfigError
    from dora_jax.sharding import create_mesh, role_meshes, rollout_mesh_config

    roles = cfg.roles
    if processes < 1:
        raise ConfigError(f"--processes {processes}: must be a positive number of processes")
    if processes == 1:
        meshes = role_meshes(cfg.mesh, roles)
        return meshes.trainer, meshes.rollout[0], meshes.shared
    devices = jax.devices()
    if len(devices) % processes:
        raise ConfigError(f"--processes {processes} does not divide target.num_devices = {len(devices)}")
    per = len(devices) // processes
    hosts = [devices[p * per:(p + 1) * per] for p in range(processes)]
    if roles.placement == "split":
        if roles.rollout_span == "all":
            raise ConfigError("roles.rollout_span=all with roles.placement='split': one engine over every "
                              "process's devices needs shared placement")
        mine = roles.trainer_devices // processes
        if roles.trainer_devices % processes or per <= mine:
            raise ConfigError(f"roles.trainer_devices = {roles.trainer_devices} over {processes} processes of "
                              f"{per} devices: each process gives the trainer the same number of its devices "
                              "and keeps some to decode")
        trainer = create_mesh(cfg.mesh, [d for h in hosts for d in h[:mine]])
        rest = hosts[0][mine:]
        if len(rest) % roles.rollout_groups:
            raise ConfigError(f"roles.rollout_groups = {roles.rollout_groups} does not divide a process's "
                              f"{len(rest)} rollout devices")
        rollout_devices = rest[:len(rest) // roles.rollout_groups]  # each process's first group
    else:
        trainer = create_mesh(cfg.mesh, devices)
        rollout_devices = list(trainer.devices.flat) if roles.rollout_span == "all" else hosts[0]
    try:
        rollout = create_mesh(rollout_mesh_config(roles), rollout_devices)
    except ConfigError as e:
        raise ConfigError(f"roles.rollout_data/rollout_tensor: a rollout engine of {len(rollout_devices)} "
                          f"devices: {e}") from None
    return trainer, rollout, roles.placement == "shared"


def run_check(cfg: Any, *, do_compile: bool = True, log: Callable[[str], None] = print,
              processes: int = 1) -> list[RoleMemory]:
    """Checks ``cfg`` on this process's devices (there must be ``cfg.target.num_devices`` of them), laid out as a
    run of ``processes`` processes (hosts) lays them out (:func:`role_meshes_of_run`).

    Returns:
      The memory of each role (one per device set: trainer and rollout share a set under ``shared``).

    Raises:
      CheckError: when the memory per device exceeds ``cfg.target.memory_gib``, or the device count is wrong.
      ConfigError: when the mesh or roles do not fit the devices, naming the field or parameter.
    """
    import jax

    from dora_jax.models.build import abstract_model
    from dora_jax.rollout.pages import plan_pool
    from dora_jax.run.placement import kv_pages

    tgt = cfg.target
    if jax.device_count() != tgt.num_devices:
        raise CheckError(f"{jax.device_count()} devices present but target.num_devices = {tgt.num_devices}; "
                         "run through check_in_subprocess (dora-jax check), which sets the device count")
    trainer_mesh, rollout_mesh, shared = role_meshes_of_run(cfg, processes)
    m = cfg.model
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_model(m)[1]))
    rollout_dtype = m.compute_dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    log(f"config {cfg.run.name}: {n_params / 1e9:.2f}B parameters ({m.param_dtype}; rollout {rollout_dtype}), target "
        f"{tgt.num_devices} x {tgt.device_kind}" + (f" with {tgt.memory_gib:g} GiB each" if tgt.memory_gib else ""))
    if processes > 1:
        where = "over every process" if cfg.roles.rollout_span == "all" else "per process"
        log(f"roles: {cfg.roles.placement}, {processes} processes; trainer mesh {dict(trainer_mesh.shape)}; rollout "
            f"mesh {dict(rollout_mesh.shape)} {where}")
    else:
        log(f"roles: {cfg.roles.placement}; trainer mesh {dict(trainer_mesh.shape)}" + ("" if shared else
            f"; {cfg.roles.rollout_groups} rollout groups of mesh {dict(rollout_mesh.shape)}"))
    train = trainer_memory(cfg, trainer_mesh, do_compile)
    roll = rollout_memory(cfg, rollout_mesh, do_compile)
    if cfg.roles.elastic_group and not shared:
        train = with_elastic_group(cfg, train, trainer_mesh, rollout_dtype != m.param_dtype, do_compile)
    if shared:
        both = RoleMemory("trainer + rollout (shared devices)", train.devices,
                          {**{f"train {k}": v for k, v in train.parts.items()},
                           **{f"rollout {k}": v for k, v in roll.parts.items()}},
                          None if train.temp is None else max(train.temp, roll.temp or 0))
        roles = [both]
    else:
        roles = [train, roll]
    for note in train.notes + roll.notes:
        log(note)
    for role in (train, roll):
        if role.temp is not None:
            log(f"compiled {role.name} step: {role.temp / 2**20:.1f} MiB scratch, {role.compiled_args / 2**20:.1f} MiB "
                "arguments per device")
    failures = []
    for role in roles:
        log(f"\nper device, {role.name} ({role.devices} devices):")
        for k, v in role.parts.items():
            log(f"  {k:<34} {v / GIB:9.3f} GiB")
        log(f"  {'activations + scratch (XLA)':<34} " + (f"{role.temp / GIB:9.3f} GiB" if role.temp is not None
                                                         else "  not compiled (--no-compile)"))
        log(f"  {'total':<34} {role.total / GIB:9.3f} GiB")
        if tgt.memory_gib and role.total > tgt.memory_gib * GIB:
            failures.append(f"{role.name} needs {role.total / GIB:.2f} GiB per device, more than target.memory_gib "
                            f"= {tgt.memory_gib:g} GiB of {tgt.device_kind}")
    if not shared:
        # What one version per group saves against every live version in every group, in this cluster's layout.
        groups = processes * cfg.roles.rollout_groups
        log("\n" + group_layouts(cfg, roll, groups, tgt.num_devices - trainer_mesh.size))
    # The pool the rollout holds, against a dense cache of every slot at the engine's length and the pool a
    # run would need if each prompt's pages were shared by its group (dora_jax/rollout/pages.py).
    plan = plan_pool(cfg)
    log(f"\nKV cache per device: a pool of {kv_pages(cfg)} pages (rollout.kv_pages"
        + (" = 0: every slot at its longest sequence)" if not cfg.rollout.kv_pages else ")"))
    for line in plan.lines(round(roll.token_bytes * plan.dense_tokens)):
        log(f"  {line}")
    if failures:
        raise CheckError("; ".join(failures) + ". Use more devices (target.num_devices and the mesh), shard "
                         "further (mesh.fsdp / mesh.tensor), fewer rollout.slots, or LoRA (train.lora.rank)")
    log("\nOK: fits" + (f" in {tgt.memory_gib:g} GiB per device" if tgt.memory_gib else " (target.memory_gib not set)"))
    return roles


def check_in_subprocess(config: str, overrides: list[str] | tuple[str, ...] = (), *, do_compile: bool = True,
                        processes: int = 1) -> int:
    """Runs the check in a fresh Python on ``target.num_devices`` fake CPU devices, laid out for a run of
    ``processes`` processes; returns its exit status (0 fits, 1 does not fit, 2 bad config). Output goes to this
    process's stdout and stderr."""
    from dora_jax.config import load_config
    from dora_jax.xla_flags import cpu_device_flags

    cfg = load_config(config, overrides)  # fail here, with the file name, on a bad config
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": cpu_device_flags(cfg.target.num_devices)}
    for name in ("DORA_COORDINATOR", "DORA_NUM_PROCESSES", "DORA_PROCESS_ID", "DORA_CLUSTER"):
        env.pop(name, None)  # the check is one process, whatever cluster it is started from
    cmd = [sys.executable, "-m", "dora_jax.check", "--config", config, *([] if do_compile else ["--no-compile"]),
           "--processes", str(processes), *overrides]
    return subprocess.run(cmd, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    """The child process of :func:`check_in_subprocess`."""
    from dora_jax.config import ConfigError, load_config

    p = argparse.ArgumentParser(prog="python -m dora_jax.check")
    p.add_argument("--config", required=True)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--processes", type=int, default=1)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        run_check(load_config(args.config, args.overrides), do_compile=not args.no_compile, processes=args.processes)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CheckError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
