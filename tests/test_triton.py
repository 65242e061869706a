"""Generated Triton kernels (under TRITON_INTERPRET=1) against the float64 oracle: forward
outputs and LSE, and gradients through the torch custom op."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen.spec import load_spec
from tests import harness
from tests.strategies import shapes, spec_toml, specs

SPECS = sorted(Path(__file__).resolve().parent.parent.joinpath("specs").glob("*.toml"))
DRAWN = {
    "drawn": specs(),
    "shape": shapes(),
    "seed": st.integers(0, 2**32 - 1),
    "scale": st.sampled_from([None, 0.05, 0.3, -0.2]),  # negative: the forward flips q
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_spec_examples(spec_file, dtype):
    """Each spec in specs/, with its own block sizes, at lengths that leave tails."""
    spec = harness.with_dtype(load_spec(spec_file), dtype)
    p = harness.make_problem(
        spec, batch=1, heads=2, q_len=300, kv_len=277, seed=11, params=harness.example_params(spec.name, 1, 2, 300, 277)
    )
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))
    c = harness.make_cotangents(p, seed=11)
    harness.assert_grads_exact(spec, p, c, harness.run_triton_grad(spec, p, c))


@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_spec_examples_long_forward(spec_file, monkeypatch):
    """The forward's long-sequence tiles at a length the short-sequence ones would take (the
    bounds read the block sizes as kernel constants, so one kernel serves both)."""
    spec = harness.with_dtype(load_spec(spec_file), "float16")
    module = harness.load_target(spec, "triton_gpu")
    if not module.SHORT_KV_LEN:
        pytest.skip("this spec has one forward configuration, run by test_spec_examples")
    monkeypatch.setattr(module, "SHORT_KV_LEN", 0)
    p = harness.make_problem(
        spec, batch=1, heads=2, q_len=300, kv_len=277, seed=12, params=harness.example_params(spec.name, 1, 2, 300, 277)
    )
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))


@pytest.mark.parametrize("name", ["causal", "document", "value_dim", "sinks", "alibi_slopes", "relative_bias"])
def test_pointer_tiles_of_gpus_without_tma(name, monkeypatch):
    """On GPUs without TMA (sm80, AMD) the forward, dQ and dK/dV kernels move their tiles through
    pointers, not tensor descriptors: the same kernels, exact, with grouped kv heads."""
    spec = harness.with_dtype(load_spec(f"specs/{name}.toml"), "float16")
    module = harness.load_target(spec, "triton_gpu")
    monkeypatch.setattr(module, "_tma", lambda device: False)
    p = harness.make_problem(
        spec, 1, 4, 200, 177, seed=13, params=harness.example_params(spec.name, 1, 4, 200, 177), kv_heads=2
    )
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))
    c = harness.make_cotangents(p, seed=13)
    harness.assert_grads_exact(spec, p, c, harness.run_triton_grad(spec, p, c))


@settings(max_examples=40)
@given(**DRAWN)
def test_drawn_specs(drawn, shape, seed, scale):
    spec = harness.spec_from_text(drawn.text)
    p = harness.make_problem(spec, shape.batch, shape.heads, shape.q_len, shape.kv_len, seed, drawn.params, scale)
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))


@settings(max_examples=7)
@given(**DRAWN)
def test_drawn_specs_gradients(drawn, shape, seed, scale):
    spec = harness.spec_from_text(drawn.text)
    p = harness.make_problem(spec, shape.batch, shape.heads, shape.q_len, shape.kv_len, seed, drawn.params, scale)
    c = harness.make_cotangents(p, seed)
    harness.assert_grads_exact(spec, p, c, harness.run_triton_grad(spec, p, c))


def test_rows_with_no_visible_key():
    """Rows that see nothing: output 0, LSE -inf, gradients 0, never NaN."""
    spec = harness.spec_from_text(spec_toml("kv_idx < w and kv_idx <= q_idx - 40"))
    p = harness.make_problem(spec, 1, 1, 100, 90, seed=5, params={"w": 30})
    out, lse = harness.run_triton(spec, p)
    assert (out[:, :, :40] == 0).all() and np.isneginf(lse[:, :, :40]).all()
    c = harness.make_cotangents(p, seed=5)
    dq, dk, dv = harness.run_triton_grad(spec, p, c)
    assert (dq[:, :, :40] == 0).all() and (dk[:, :, 30:] == 0).all() and (dv[:, :, 30:] == 0).all()
    harness.assert_grads_exact(spec, p, c, (dq, dk, dv))
