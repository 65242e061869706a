"""Generated Pallas TPU kernels, run on the CPU in interpret mode, against the float64 oracle:
forward, gradients through jax.custom_vjp, and jit / grad / vmap."""

import numpy as np
import pytest
from hypothesis import given, settings

from attngen.spec import load_spec, with_config
from tests import harness
from tests.test_triton import DRAWN, SPECS


def _tpu_interpret_params():
    from jax.experimental.pallas import tpu as pltpu

    # Uninitialised memory reads as NaN, so a read of unwritten scratch shows in the output.
    return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def _races_found() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    races = interpret_pallas_call.races
    return races is not None and races.races_found


def _small_blocks(spec):
    """Blocks small enough for EMPTY, PARTIAL and FULL tiles and tails at test lengths."""
    return with_config(spec, "pallas_tpu", block_q=64, block_kv=128)


# TPU interpret mode (~8 s a spec on a CPU) runs a spread of specs/ that takes every branch of the
# Pallas templates: closed-form tile bounds and no mask, block tables, a score reading a head's
# tensor entry (trained), a table over positions, a sink (trained), varlen, a value width of its own.
# tests/test_variants.py runs every spec on both targets, in plain interpret mode.
TPU_INTERPRET_SPECS = ("causal", "full", "document", "alibi_slopes", "relative_bias", "sinks", "varlen", "value_dim")


@pytest.mark.parametrize("spec_file", [p for p in SPECS if p.stem in TPU_INTERPRET_SPECS], ids=lambda p: p.stem)
def test_spec_examples_tpu_interpret(spec_file):
    """specs/ in TPU interpret mode, forward and backward kernels: race detection on, scratch
    poisoned with NaN. Each spec in its own dtype; tests/test_variants.py draws the others."""
    spec = _small_blocks(load_spec(spec_file))
    p = harness.make_problem(
        spec, batch=1, heads=2, q_len=300, kv_len=333, seed=7, params=harness.example_params(spec.name, 1, 2, 300, 333)
    )
    interpret = _tpu_interpret_params()
    harness.assert_exact(spec, p, *harness.run_pallas(spec, p, interpret=interpret))
    c = harness.make_cotangents(p, seed=7)
    harness.assert_grads_exact(spec, p, c, harness.run_pallas_grad(spec, p, c, interpret=interpret))
    assert not _races_found(), "TPU interpret mode detected a race"


@settings(max_examples=15)
@given(**DRAWN)
def test_drawn_specs(drawn, shape, seed, scale):
    spec = harness.spec_from_text(drawn.text)
    p = harness.make_problem(spec, shape.batch, shape.heads, shape.q_len, shape.kv_len, seed, drawn.params, scale)
    harness.assert_exact(spec, p, *harness.run_pallas(spec, p))


@settings(max_examples=6)
@given(**DRAWN)
def test_drawn_specs_gradients(drawn, shape, seed, scale):
    spec = harness.spec_from_text(drawn.text)
    p = harness.make_problem(spec, shape.batch, shape.heads, shape.q_len, shape.kv_len, seed, drawn.params, scale)
    c = harness.make_cotangents(p, seed)
    harness.assert_grads_exact(spec, p, c, harness.run_pallas_grad(spec, p, c))


def test_jit_grad_and_vmap():
    """jax.jit of jax.grad, and vmap over an extra leading axis, agree with the unbatched call."""
    import jax
    import jax.numpy as jnp

    spec = _small_blocks(harness.with_dtype(load_spec("specs/sliding_window.toml"), "float32"))
    module = harness.load_target(spec, "pallas_tpu")
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 1, 2, 70, spec.head_dim)), jnp.float32) for _ in range(3))

    def loss(q, k, v):
        return jnp.sum(module.attention(q, k, v, window=20, interpret=True) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q[0], k[0], v[0])
    p = harness.Problem(*(np.asarray(x[0]) for x in (q, k, v)), "float32", None, {"window": 20})
    out = np.asarray(module.attention(q[0], k[0], v[0], window=20, interpret=True))
    c = harness.Cotangents(2 * out, np.zeros(out.shape[:3], np.float32))
    harness.assert_grads_exact(spec, p, c, grads)

    batched = jax.vmap(lambda q, k, v: module.attention(q, k, v, window=20, interpret=True))(q, k, v)
    for i in range(3):
        np.testing.assert_allclose(
            batched[i], module.attention(q[i], k[i], v[i], window=20, interpret=True), rtol=1e-6, atol=1e-6
        )
    batched_grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for ours, single in zip(batched_grads, grads):
        np.testing.assert_allclose(ours[0], single, rtol=1e-5, atol=1e-5)


def test_rows_with_no_visible_key():
    from tests.strategies import spec_toml

    spec = harness.spec_from_text(spec_toml("kv_idx < w and kv_idx <= q_idx - 40"))
    p = harness.make_problem(spec, 1, 1, 100, 90, seed=5, params={"w": 30})
    out, lse = harness.run_pallas(spec, p)
    assert (out[:, :, :40] == 0).all() and np.isneginf(lse[:, :, :40]).all()
    c = harness.make_cotangents(p, seed=5)
    dq, dk, dv = harness.run_pallas_grad(spec, p, c)
    assert (dq[:, :, :40] == 0).all() and (dk[:, :, 30:] == 0).all() and (dv[:, :, 30:] == 0).all()
    harness.assert_grads_exact(spec, p, c, (dq, dk, dv))
