"""The compile counter, the program registry's late-compile log, and the HLO kernel count: each shown to see a
compile (or a kernel) that is there, and to stay at zero where none is."""

import logging

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.hlo import layer_kernels
from dora_jax.compiles import COUNTER, Programs, compile_count, describe_args


def test_the_counter_counts_a_new_shape_and_not_a_cached_call():
    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    x = np.arange(7, dtype=np.float32)
    before = compile_count()
    f(x).block_until_ready()
    first = compile_count() - before
    assert first.compiles + first.cache_loads == 1  # a persistent cache may hold it: a load, not a compile
    before = compile_count()
    f(x + 1).block_until_ready()  # same shape: nothing new
    assert compile_count() - before == type(before)(0, 0)
    before = compile_count()
    f(np.arange(9, dtype=np.float32)).block_until_ready()  # a new shape
    second = compile_count() - before
    assert second.compiles + second.cache_loads == 1
    assert COUNTER.names()["jit(<lambda>)"] >= 1


def test_programs_log_a_compile_after_seal_with_its_shapes_and_not_a_warmed_one(caplog):
    progs = Programs("test owner")
    double = progs.jit("double", lambda x, n: x * n, static_argnums=(1,))
    progs.compile("double", jax.ShapeDtypeStruct((4, 3), np.float32), 2)  # ahead of time, not run
    assert progs.total_warmed == 1
    progs.seal()
    with caplog.at_level(logging.WARNING, logger="dora_jax.compiles"):
        np.testing.assert_allclose(double(np.ones((4, 3), np.float32), 2), 2.0)  # the warmed shape
        assert progs.late == [] and not caplog.records
        double(np.ones((5, 3), np.float32), 2)  # a shape warm-up did not compile
    assert [name for name, _ in progs.late] == ["double"]
    assert "float32[5,3]" in progs.late[0][1] and "2" in progs.late[0][1]
    assert "double" in caplog.text and "float32[5,3]" in caplog.text


def test_describe_args_names_shapes_and_static_values():
    assert describe_args((np.zeros((2, 3), np.int32), 7)) == "int32[2,3], 7"


def test_layer_kernels_finds_the_layer_loop_and_counts_its_work():
    def layers(w, x):
        def body(h, wl):
            h = jnp.tanh(h @ wl) + 1.0
            return h, h.sum()

        return jax.lax.scan(body, x, w)

    w, x = jnp.ones((5, 8, 8)), jnp.ones((2, 8))
    text = jax.jit(layers).lower(w, x).compile().as_text()
    got = layer_kernels(text, 5)
    assert got is not None and got["per_layer"] >= 1 and got["inner_loops"] == []
    assert layer_kernels(text, 4) is None  # no loop of that many trips
    assert layer_kernels("HloModule empty\n", 5) is None


def test_layer_kernels_counts_each_loop_inside_a_layer_in_order():
    """Two loops of data-dependent trips in each layer (XLA may put one inside a call of its own): a larger body
    (a dot, a tanh, a sort) then a smaller one (a product), each with a condition of one kernel (the compare);
    found by their name scope, a loop outside it counted once with the layer's own kernels."""
    def layers(w, x, n):
        def body(h, wl):
            def big(c):
                return c[0] + 1, jnp.sort(jnp.tanh(c[1] @ wl), axis=-1)

            def small(c):
                return c[0] + 1, c[1] * 2.0

            with jax.named_scope("tiles_big"):
                _, h = jax.lax.while_loop(lambda c: c[0] < n, big, (0, h))
            with jax.named_scope("tiles_small"):
                _, h = jax.lax.while_loop(lambda c: c[0] < n, small, (0, h))
            return h, h.sum()

        # A loop of as many trips before the layers' (XLA:CPU makes one of a scatter over a few rows).
        x = jax.lax.fori_loop(0, 5, lambda i, a: jnp.sin(a) * i, x)
        return jax.lax.scan(body, x, w)

    text = jax.jit(layers).lower(jnp.ones((5, 8, 8)), jnp.ones((2, 8)), 3).compile().as_text()
    assert text.count('known_trip_count":{"n":"5"') >= 2
    got = layer_kernels(text, 5, inner="tiles_")
    (big, big_cond), (small, small_cond) = got["inner_loops"]
    assert big >= 3 and 1 <= small < big and big_cond == small_cond == 1 and got["per_layer"] >= 1
    one = layer_kernels(text, 5, inner="tiles_small")
    assert one["inner_loops"] == [[small, small_cond]]
    assert one["per_layer"] == got["per_layer"] + big + big_cond
