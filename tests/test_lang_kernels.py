"""The expression language's newer values in the kernels, both targets, forward and gradients
against the float64 reference: scores of -inf (a FlexAttention score_mod's way to drop a key, up
to whole rows), bool tensor params, sin / cos / tan / exp2 / log2, expressions over several
lines, and `not` of what is constant. (Parsing and typing them: test_lang.py.)"""

import numpy as np
import pytest

from attngen.spec import load_spec, retarget
from tests import harness
from tests.test_kvcache import _run, check

BLOCKS = """[triton]
block_m = 16
block_n = 16
dq_block_m = 16
dq_block_n = 16
dkdv_block_m = 16
dkdv_block_n = 16
[pallas_tpu]
block_q = 16
block_kv = 128
"""
CUTOFF = (
    'name = "cutoff"\nhead_dim = 32\ndtype = "float32"\n[mask]\ncausal = true\n'
    '[score]\nexpr = """\nwhere(score > bound[b],\n      -inf,\n      score)\n"""\n[params]\nbound = "float[batch]"\n'
    + BLOCKS
)


def bound_between_scores(q, k, quantile):
    """A float32 bound halfway between two neighbouring float64 scores of q, k at `quantile`: no
    score lies within float32 rounding of it, so the kernels drop exactly the keys the reference
    drops."""
    scores = np.sort(np.unique(np.einsum("hqd,hkd->hqk", q, k).ravel() / np.sqrt(q.shape[-1])))
    i = int(quantile * (len(scores) - 1))
    return np.float32((scores[i] + scores[i + 1]) / 2)


@pytest.mark.parametrize("target", ["triton", "pallas"])
@pytest.mark.parametrize(
    "mask",
    [
        "(not (w < w)) == (not (33 < 25))",  # true everywhere
        "2 <= where(not (39 > 26), 30, q_idx)",  # q_idx >= 2
        "(kv_idx <= q_idx) == (not (1 > 2))",  # causal
    ],
)
def test_not_of_a_constant(target, mask):
    """`not` of a comparison of constants, which the kernels fold to a bool as they trace: Triton's
    `~` made ~False == -1, so the first mask was false everywhere and the second true (found by the
    fuzzer: drawn specs, fresh draws)."""
    params = {"w": 3} if "(w " in mask else {}
    declared = '[params]\nw = "int"\n' if params else ""
    spec = harness.spec_from_text(
        f'name = "n"\nhead_dim = 32\ndtype = "float32"\n[mask]\nexpr = "{mask}"\n{declared}{BLOCKS}'
    )
    run, run_grad = harness.TARGETS[target]
    p = harness.make_problem(spec, 1, 2, 37, 45, seed=2, params=params)
    harness.assert_exact(spec, p, *run(spec, p))
    c = harness.make_cotangents(p, seed=2)
    harness.assert_grads_exact(spec, p, c, run_grad(spec, p, c))


@pytest.mark.parametrize("target", ["triton", "pallas"])
def test_flex_style_cutoff_to_minus_inf(target):
    """Sequence 0 drops the keys above its median score (some rows lose every key they see),
    sequence 1 drops every key: its rows are empty, output 0, LSE -inf, gradients 0, no NaN."""
    spec = harness.spec_from_text(CUTOFF)
    p = harness.make_problem(spec, 2, 2, 40, 36, seed=3, params={})
    bound = np.array([bound_between_scores(p.q[0], p.k[0], 0.5), -3e38], np.float32)
    p = harness.make_problem(spec, 2, 2, 40, 36, seed=3, params={"bound": bound})
    run, run_grad = harness.TARGETS[target]
    out, lse = run(spec, p)
    harness.assert_exact(spec, p, out, lse)
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    assert np.isneginf(lse[0]).any() and np.isfinite(lse[0]).any()
    c = harness.make_cotangents(p, seed=3)
    grads = run_grad(spec, p, c)
    harness.assert_grads_exact(spec, p, c, grads)
    assert all((g[1] == 0).all() and np.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("target", ["triton", "pallas"])
def test_bool_mask_table_and_the_new_functions(target):
    """A bool[batch, kv_len] key-padding table in the mask (read per position: block tables on
    Triton, a gathered array on Pallas) and a score using every new function, spread over lines."""
    text = (
        'name = "table"\nhead_dim = 32\ndtype = "float32"\n[mask]\nexpr = """\nkeep[b, kv_idx]\n  and q_idx >= kv_idx\n"""\n'
        '[score]\nexpr = """\nscore + 0.5 * sin(score) - 0.25 * cos(2.0 * score) + tan(0.5 * tanh(score))\n'
        '  + log2(1.0 + exp2(score)) * 0.5\n"""\n[params]\nkeep = "bool[batch, kv_len]"\n' + BLOCKS
    )
    spec = harness.spec_from_text(text)
    keep = np.random.default_rng(4).random((2, 36)) < 0.7
    keep[1, :6] = False  # the first rows of sequence 1 see no key
    p = harness.make_problem(spec, 2, 2, 40, 36, seed=4, params={"keep": keep})
    run, run_grad = harness.TARGETS[target]
    out, lse = run(spec, p)
    harness.assert_exact(spec, p, out, lse)
    assert np.isneginf(lse[1, :, :6]).all()
    c = harness.make_cotangents(p, seed=4)
    harness.assert_grads_exact(spec, p, c, run_grad(spec, p, c))


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_bool_tensors_are_checked(target):
    text = 'name = "t"\nhead_dim = 64\ndtype = "float32"\n[mask]\nexpr = "keep[h] or q_idx >= kv_idx"\n[params]\nkeep = "bool[heads]"\n'
    module = harness.load_target(harness.spec_from_text(text), target)
    if target == "triton_gpu":
        import torch

        make, options = torch.as_tensor, {}
    else:
        import jax.numpy as jnp

        make, options = jnp.asarray, {"interpret": True}
    q = make(np.ones((1, 2, 8, 64), np.float32))
    with pytest.raises(TypeError, match="param keep must be bool, got"):
        module.attention(q, q, q, keep=make(np.ones(2, np.int32)), **options)


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_decoding_with_a_cutoff_to_minus_inf(target):
    """specs/score_cutoff.toml from a KV cache: exact against attention over the whole sequence;
    a sequence whose bound drops every key gives empty rows, as in training."""
    problem = {
        "dtype": "float32", "batch": 2, "kv_heads": 1, "heads": 2, "new_tokens": 3, "capacity": 40,
        "page_size": None, "seqlens": [40, 29], "num_splits": 2, "seed": 5,
    }  # fmt: skip
    check("score_cutoff", problem, target)
    spec = retarget(load_spec("specs/score_cutoff.toml"), 32, "float32")
    rng = np.random.default_rng(5)
    q, k, v = (
        rng.standard_normal(shape).astype(np.float32) for shape in ((2, 2, 3, 32), (2, 1, 40, 32), (2, 1, 40, 32))
    )
    bound = np.array([-3e38, 2.0], np.float32)
    seqlens = np.array([40, 29], np.int32)
    out, lse = _run(target, spec, "float32", q, k, v, seqlens, None, None, 2, {"bound": bound})
    assert (out[0] == 0).all() and np.isneginf(lse[0]).all() and np.isfinite(lse[1]).all()
