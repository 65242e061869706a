"""Numerics at the edges, on both targets: empty and one-element shapes, logits of +-1e4 and
beyond FLT_MAX / log2(e), and non-finite inputs.

The contract for inputs holding NaN or +-inf (README, Semantics): non-finite q or k make
non-finite exactly the rows the float64 reference cannot compute, and leave the others exact
(masking replaces scores before the softmax, so a key a row cannot see never reaches it); a NaN
or inf in v makes NaN every row that can see it, and may reach rows that
cannot see it when it shares a tile with keys they see (a masked key enters P.V with weight 0,
and 0 * NaN is NaN, as in FlashAttention).
"""

import numpy as np
import pytest
import torch

from attngen import exactness
from attngen.reference import attention_ref
from attngen.spec import load_spec, retarget
from attngen.testing import example_params
from tests import harness
from tests.strategies import FLOAT_PARAM, spec_toml

SMALL_TILES = "[triton]\nblock_m = 16\nblock_n = 16\n[pallas_tpu]\nblock_q = 16\nblock_kv = 128\n"


def causal_spec(dtype="float32"):
    return harness.spec_from_text(spec_toml("causal", head_dim=32, extra=(f'dtype = "{dtype}"',)) + SMALL_TILES)


@pytest.mark.parametrize("target", harness.TARGETS)
@pytest.mark.parametrize(
    "shape", [(0, 2, 5, 5), (1, 2, 0, 5), (1, 2, 5, 0), (1, 2, 0, 0), (1, 2, 1, 1), (2, 1, 1, 7)], ids=str
)
def test_empty_and_single_element_shapes(target, shape):
    """Batch 0, sequences of 0 or 1: the right shapes; no key gives 0 / -inf / zero gradients."""
    run, run_grad = harness.TARGETS[target]
    spec = causal_spec()
    p = harness.make_problem(spec, *shape, seed=3, params={})
    out, lse = run(spec, p)
    assert out.shape == p.q.shape and lse.shape == p.q.shape[:3]
    c = harness.make_cotangents(p, seed=3)
    grads = run_grad(spec, p, c)
    assert [g.shape for g in grads] == [p.q.shape, p.k.shape, p.v.shape]
    if out.size:
        harness.assert_exact(spec, p, out, lse)
        harness.assert_grads_exact(spec, p, c, grads)
    if shape[3] == 0:  # no key at all
        assert (out == 0).all() and np.isneginf(lse).all() and all((g == 0).all() for g in grads)


@pytest.mark.parametrize("target", harness.TARGETS)
@pytest.mark.parametrize("name", ["document", "varlen"])
@pytest.mark.parametrize("shape", [(0, 2, 5, 5), (1, 2, 0, 5), (1, 2, 5, 0), (1, 2, 0, 0)], ids=str)
def test_empty_shapes_with_tensor_params_along_them(target, name, shape):
    """Tensor params along the problem's axes ([batch, q_len], [batch, kv_len]: a packed batch's
    sequence ids) are empty with them, and no element of them is read: empty outputs, or 0 / -inf
    where no key is (they were refused, so attention_varlen failed where no sequence had a query)."""
    spec = retarget(load_spec(f"specs/{name}.toml"), 32, "float32")
    sizes = dict(zip(("batch", "heads", "q_len", "kv_len"), shape))
    params = example_params(name, *shape) if shape[0] else {}  # (varlen's examples need a sequence)
    params = params or {p.name: np.zeros([sizes[a] for a in p.shape], np.int32) for p in spec.params if p.is_tensor}
    assert any(0 in value.shape for value in params.values())
    run, run_grad = harness.TARGETS[target]
    p = harness.make_problem(spec, *shape, seed=5, params=params)
    out, lse = run(spec, p)
    assert out.shape == p.q.shape and lse.shape == p.q.shape[:3]
    grads = run_grad(spec, p, harness.make_cotangents(p, seed=5))
    assert [g.shape for g in grads] == [p.q.shape, p.k.shape, p.v.shape]
    if shape[3] == 0:  # no key at all
        assert (out == 0).all() and np.isneginf(lse).all() and all((g == 0).all() for g in grads)


def test_an_empty_tensor_param_along_its_own_axis_is_refused():
    """A table whose axis is its own (not the problem's) would be read, clamped, past its end."""
    spec = retarget(load_spec("specs/relative_bias.toml"), 32, "float32")
    module = harness.load_target(spec, "triton_gpu")
    q = torch.randn(1, 2, 8, spec.head_dim)
    with pytest.raises(ValueError, match="param rel_bias is empty along"):
        module.attention(q, q, q, rel_bias=torch.zeros(2, 0), max_dist=4)


@pytest.mark.parametrize("target", harness.TARGETS)
@pytest.mark.parametrize("mask", [None, "causal"])
def test_logits_of_1e4(target, mask):
    """Logits spanning +-1e4 after scaling: no overflow, and as exact as a float32 framework."""
    run, run_grad = harness.TARGETS[target]
    spec = harness.spec_from_text(spec_toml(mask, head_dim=32, extra=('dtype = "float32"',)) + SMALL_TILES)
    p = harness.make_problem(spec, 1, 2, 40, 40, seed=11, params={})
    scale = 1e4 / np.abs(np.matmul(p.q, p.k.swapaxes(-1, -2))).max()
    p = harness.Problem(p.q, p.k, p.v, p.dtype, float(scale), p.params)
    out, lse = run(spec, p)
    ref_out, ref_lse = attention_ref(spec, p.q, p.k, p.v, scale=p.scale)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    # float32 scores of this size carry an absolute error of ~1e-3: judge against a float32
    # implementation of the same formula (the FlashAttention rule), not a fixed tolerance.
    fp32_err = np.abs(exactness.lowp_baseline(spec, p.q, p.k, p.v, p.dtype, scale=p.scale) - ref_out).max()
    assert np.abs(out - ref_out).max() <= 2 * fp32_err + exactness.FLOOR["float32"]
    # The LSE is of the logits' size: a few float32 ulps of 1e4 (2**-23 * 1e4 = 1.2e-3 each).
    assert np.abs(lse - ref_lse).max() <= 4 * 2.0**-23 * 1e4
    c = harness.make_cotangents(p, seed=11)
    assert all(np.isfinite(g).all() for g in run_grad(spec, p, c))


@pytest.mark.parametrize("target", harness.TARGETS)
@pytest.mark.parametrize(
    ("score", "c"), [(f"min(score, {FLOAT_PARAM})", -3e38), (f"max(score, {FLOAT_PARAM})", 2.4e38)]
)
def test_logits_beyond_float_max_over_log2e(target, score, c):
    """Every logit equal to c, beyond FLT_MAX / log2(e) = 2.36e38 (where base-2 units overflow):
    the output is the mean of v and the LSE c + log(keys). The gradients are finite, not exact: the
    backward recomputes P from the float32 LSE, which cannot hold log(keys) beside c (README, Semantics)."""
    run, run_grad = harness.TARGETS[target]
    spec = harness.spec_from_text(spec_toml(None, score, head_dim=32, extra=('dtype = "float32"',)) + SMALL_TILES)
    p = harness.make_problem(spec, 1, 2, 4, 37, seed=5, params={FLOAT_PARAM: c})
    out, lse = run(spec, p)
    np.testing.assert_allclose(out, np.broadcast_to(p.v.mean(axis=2, keepdims=True), out.shape), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, c + np.log(37.0), rtol=1e-6)
    c = harness.make_cotangents(p, seed=5)
    assert all(np.isfinite(g).all() for g in run_grad(spec, p, c))


@pytest.mark.parametrize("target", harness.TARGETS)
def test_non_finite_inputs(target):
    """NaN in q or k, inf in k: as the float64 reference; NaN in v: NaN where the contract says."""
    run, _ = harness.TARGETS[target]
    spec = causal_spec()
    base = harness.make_problem(spec, 1, 1, 64, 64, seed=7, params={})
    for which, row, value in (("q", 5, np.nan), ("k", 50, np.inf), ("k", 50, -np.inf), ("k", 50, np.nan)):
        x = {"q": base.q.copy(), "k": base.k.copy(), "v": base.v}
        x[which][0, 0, row, :4] = value
        out, lse = run(spec, harness.Problem(x["q"], x["k"], x["v"], base.dtype, None, {}))
        ref_out, ref_lse = attention_ref(spec, x["q"], x["k"], x["v"])
        broken = ~np.isfinite(ref_out).all(-1)  # rows the reference cannot compute either
        assert broken.any(), "the case must reach the softmax"
        assert np.array_equal(~np.isfinite(out).all(-1), broken), f"{which} = {value}: non-finite rows"
        assert np.array_equal(~np.isfinite(lse), ~np.isfinite(ref_lse)), f"{which} = {value}: non-finite LSE"
        np.testing.assert_allclose(out[~broken], ref_out[~broken], atol=2e-5, err_msg=f"{which} = {value}")
        np.testing.assert_allclose(lse[~broken], ref_lse[~broken], rtol=1e-5, err_msg=f"{which} = {value}")

    # A NaN value: the float64 reference (P @ V) spreads it to every row through 0 * NaN; the
    # kernels only to the rows whose tiles hold it.
    v = base.v.copy()
    v[0, 0, 50, 0] = np.nan
    out, _ = run(spec, harness.Problem(base.q, base.k, v, base.dtype, None, {}))
    ref_out, _ = attention_ref(spec, base.q, base.k, base.v)
    assert np.isnan(out[0, 0, 50:, 0]).all(), "rows that see the value are NaN in its column"
    # Rows whose q block never visits the value's tile are exact: with Triton's 16-key tiles,
    # rows < 48; Pallas' one 128-key tile holds every key.
    untouched = 48 if target == "triton" else 0
    np.testing.assert_allclose(out[0, 0, :untouched], ref_out[0, 0, :untouched], atol=2e-5)
