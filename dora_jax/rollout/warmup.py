"""The rollout engine's fixed set of programs, and their compilation before a run's first update.

An :class:`~dora_jax.rollout.engine.Engine` dispatches programs of a few shapes only: decode per number of
versions stepped together, decode-state capacity and sampling variant (page tables are always full width);
prefill per distinct-prompt rows and prompt bucket. :func:`program_catalog` lists them, :func:`warmup_plan`
gives each its abstract arguments in the layouts the calls will have, and :func:`warmup` compiles them all, after
which the engine logs any compile with its shape (:class:`~dora_jax.compiles.Programs`).
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from dora_jax.rollout.engine import Engine, prompt_rows, resolve_decode_steps
from dora_jax.rollout.engine_api import PrefixBatch
from dora_jax.rollout.pages import bucket
from dora_jax.rollout.sampling import SamplingParams

def capacities(engine: Engine) -> list[int]:
    """The decode-state capacities a driver uses: powers of two below the slots, and the slots (every slot on an
    engine whose slots split over batch shards, where a driver never compacts)."""
    full = engine.max_concurrent_decodes
    if engine.shards > 1:
        return [full]
    return sorted({min(1 << i, full) for i in range(full.bit_length() + 1)})


def prompt_buckets(engine: Engine, prefix_tokens: int = 0) -> list[int]:
    """The prompt buckets :meth:`Engine.prefill_batch` compiles for prompts after a prefix of ``prefix_tokens``."""
    longest = engine.max_prefill_length - prefix_tokens
    lengths = {min(1 << i, longest) for i in range(longest.bit_length() + 1)}
    return sorted({min(bucket(x), engine.max_target_length - prefix_tokens) for x in lengths})


def program_catalog(engine: Engine, *, versions: int = 1, decode_steps: int | None = None,
                    filtered: Sequence[bool] = (False,), prefix_tokens: int = 0, prefill_tokens: int = 8192
                    ) -> list[tuple]:
    """Every program shape a :class:`~dora_jax.rollout.driver.RolloutDriver` of ``engine`` can dispatch, as
    ``(program, *shape key)``: what :func:`warmup` compiles and ``dora-jax check`` counts.

    Args:
      versions: the most policy versions the driver steps together (K + 1).
      decode_steps: the driver's decode steps per program (default: the engine's setting).
      filtered: the sampling variants (:func:`~dora_jax.rollout.sampling.needs_filter` of the requests).
      prefix_tokens: the driver's shared prefix (0: prompts are prefilled whole).
      prefill_tokens: the driver's prefill budget (distinct prompts x prompt bucket per program).
    """
    steps = resolve_decode_steps(engine.settings) if decode_steps is None else int(decode_steps)
    caps = capacities(engine)
    out: list[tuple] = [("generate_steps", v, cap, bool(f), steps)
                        for v in range(1, versions + 1) for cap in caps for f in dict.fromkeys(filtered)]
    for cap in caps:
        out += [("zeros", cap)] + [("resize", cap, new) for new in caps if new != cap]
    if prefix_tokens:
        out.append(("shared_prefix", prefix_tokens))
    n = engine.request_rows
    # Prefill and first tokens: distinct prompts (powers of four) x prompt bucket within the driver's budget,
    # then the pool write, and the slots set in a decode state of every capacity.
    for t in prompt_buckets(engine, prefix_tokens):
        for d in sorted({prompt_rows(1 << i, engine.max_concurrent_decodes) for i in range(n.bit_length() + 1)}):
            if d == 1 or d * t <= prefill_tokens:
                out.append(("prefill_batch", d, t))
                out.append(("write_prompts", d, t))
    out += [("set_slots", cap) for cap in caps]
    return out


def _spec(engine: Engine, x: Any) -> Any:
    """A device array as an abstract argument with its sharding (the program is compiled for that layout); host
    values as they are. Without a mesh every array sits on the default device uncommitted: no sharding, as calls
    see them."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding if engine.mesh is not None else None)
    return x


def _outputs(engine: Engine, name: str, calls: dict[Any, tuple], on_compiled: Callable[[str], Any] | None
             ) -> dict[Any, Any]:
    """Program ``name``'s outputs for the arguments of each of ``calls`` (by key), abstract, in the layout its
    compiled form gives them (what a program fed by them is compiled for). Compiles them, on every core at once
    (``on_compiled(name)`` after each): warm-up compiles them anyway, and JAX keeps them."""
    lowered = {key: engine.compiled.lower(name, *args) for key, args in calls.items()}  # tracing holds the GIL

    def compile_one(x):
        out = x.compile()
        if on_compiled is not None:
            on_compiled(name)
        return out

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        compiled = dict(zip(lowered, pool.map(compile_one, lowered.values())))
    if engine.mesh is None:
        return {key: x.out_info for key, x in lowered.items()}
    return {key: jax.tree.map(lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
                              x.out_info, compiled[key].output_shardings) for key, x in lowered.items()}


def warmup_plan(engine: Engine, params: Any = None, *, stop_width: int = 4, prefix_tokens: int = 0,
                on_compiled: Callable[[str], Any] | None = None, **catalog_args: Any) -> list[tuple[str, tuple]]:
    """:func:`program_catalog` (same arguments) as ``(program, arguments)`` to compile, arguments abstract where
    they are device arrays. ``params``: prepared params of one version (``None``: the engine's own; only shapes
    are used); ``stop_width``: stop ids per slot, as :func:`~dora_jax.rollout.engine_api.stop_table` pads them.
    Programs whose outputs feed others (the prefill chain) are compiled here to learn their outputs' layouts,
    ``on_compiled`` called with the program's name after each."""
    spec = lambda x: _spec(engine, x)  # noqa: E731
    prepared = jax.tree.map(spec, engine.prepare_params(params))
    pool = jax.tree.map(spec, engine.pool)
    width, n = engine.table_width, engine.request_rows
    states = {cap: jax.tree.map(spec, engine.init_decode_state(cap)) for cap in capacities(engine)}

    def host(cap, dtype, value=0, *tail):
        return np.full((cap,) + tail, value, dtype)

    prefix = None
    if prefix_tokens:
        prefix = _outputs(engine, "shared_prefix", {0: (prepared, jax.ShapeDtypeStruct((prefix_tokens,), np.int32))},
                          on_compiled)[0]
    sampling = SamplingParams(host(n, np.float32), host(n, np.int32), host(n, np.float32, 1.0))

    def prefill(d, t):
        lengths = np.ones((d,), np.int32)
        return (prepared, np.zeros((d, t), np.int32), lengths, prefix, lengths, host(n, np.int32), host(n, bool),
                host(n, np.int32), np.int32(0), host(n, np.int32), sampling)

    catalog = program_catalog(engine, prefix_tokens=prefix_tokens, **catalog_args)
    # (distinct prompts, bucket) -> prefill_batch's outputs, which the pool writes and set_slots take
    outputs = _outputs(engine, "prefill_batch", {tuple(key): prefill(*key) for name, *key in catalog
                                                 if name == "prefill_batch"}, on_compiled)

    plan: list[tuple[str, tuple]] = []
    for name, *key in catalog:
        if name == "generate_steps":
            v, cap, f, steps = key
            args = ((prepared,) * v, (states[cap],) * v, pool, tuple(host(cap, np.int32, 0, width) for _ in range(v)),
                    tuple(host(cap, np.int32) for _ in range(v)),
                    tuple(host(cap, np.int32, -1, stop_width) for _ in range(v)),
                    tuple(host(cap, bool) for _ in range(v)), np.zeros((v,), np.int32), np.int32(0), steps, f)
        elif name == "zeros":
            args = (key[0],)
        elif name == "resize":
            args = (states[key[0]], host(key[1], np.int32, -1), key[1])
        elif name == "shared_prefix":
            args = (prepared, jax.ShapeDtypeStruct((prefix_tokens,), np.int32))
        elif name == "prefill_batch":
            args = prefill(*key)
        elif name == "write_prompts":
            cache, rest, _ = outputs[tuple(key)]
            cols = cache.v.shape[3]
            args = (cache, rest[0], pool, host(n, np.int32, 0, cols), host(n, np.int32, 0, cols))
        else:  # set_slots
            _, rest, _ = outputs[1, prompt_buckets(engine, prefix_tokens)[0]]
            args = (PrefixBatch(None, *rest), states[key[0]], host(n, np.int32))
        plan.append((name, args))
    return plan


def warmup(engine: Engine, params: Any = None, *, progress: bool = False, **plan_args: Any) -> dict[str, Any]:
    """Compiles every program of :func:`warmup_plan` (same arguments) without running any, then seals the engine's
    programs: a later compile is logged with its shape.

    Returns:
      ``programs`` (compiled now), ``seconds`` (the warm-up's wall time), ``by_program`` (counts).
    """
    from tqdm.auto import tqdm

    start = time.perf_counter()
    compiled = engine.compiled
    with tqdm(total=len(program_catalog(engine, **{k: v for k, v in plan_args.items() if k != "stop_width"})),
              desc="compiling rollout programs", unit="program", disable=not progress, leave=False) as bar:
        planned: set[str] = set()  # programs the plan compiled (the prefill chain): their calls below find them

        def done(name):
            planned.add(name)
            bar.update()

        plan = warmup_plan(engine, params, on_compiled=done, **plan_args)
        # Tracing holds the GIL, XLA's compiler does not: programs are traced here one by one and compiled on
        # every core at once.
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            futures = {pool.submit(compiled.compile_lowered, name, compiled.lower(name, *args)): name
                       for name, args in plan}
            for f in concurrent.futures.as_completed(futures):
                f.result()
                if futures[f] not in planned:
                    bar.update()
    compiled.seal()
    by_program: dict[str, int] = {}
    for name, _ in plan:
        by_program[name] = by_program.get(name, 0) + 1
    return {"programs": len(plan), "seconds": time.perf_counter() - start, "by_program": by_program}
