"""Tensor params: declaring them, indexing them in expressions, the clamping rule, what the tile
analysis makes of them, and the checks the generated functions run on the tensors they are given.
(Exactness of the specs/ that use them runs in test_triton and test_pallas.)"""

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen import ir
from attngen.analysis import analyse_mask
from attngen.errors import SpecError
from attngen.reference import attention_ref, evaluate
from attngen.spec import load_spec, parse_spec
from tests import harness
from tests.test_analysis import EMPTY, FULL, brute_force, classify

ROOT = Path(__file__).resolve().parent.parent
GOOD = 'name = "t"\nhead_dim = 64\ndtype = "float32"\n'


def spec_with(params: str, mask: str | None = None, score: str | None = None):
    text = GOOD + (f'[mask]\nexpr = "{mask}"\n' if mask else "") + (f'[score]\nexpr = "{score}"\n' if score else "")
    return parse_spec(text + f"[params]\n{params}\n", "t.toml")


def problems(params: str, mask: str | None = None, score: str | None = None) -> str:
    with pytest.raises(SpecError) as e:
        spec_with(params, mask, score)
    return "\n".join(d.render() for d in e.value.diagnostics)


def test_declarations():
    spec = spec_with('rel = "float[heads, buckets]"', score="score + rel[h, q_idx - kv_idx]")
    (rel,) = spec.params
    assert rel.shape == ("heads", "buckets") and rel.type is ir.Type.FLOAT and rel.declared == "float[heads, buckets]"
    spec = spec_with(
        'prefix = "int[ batch ]"\nt = "float[4, heads, q_len, kv_len]"',
        mask="kv_idx < prefix[b]",
        score="score + t[3, h, q_idx, kv_idx]",
    )
    assert [p.shape for p in spec.params] == [("batch",), (4, "heads", "q_len", "kv_len")]


@pytest.mark.parametrize(
    "declared, message",
    [
        ('"float[]"', "neither a positive int nor a size name"),
        ('"float[a, b, c, d, e]"', "1 to 4 axes, got 5"),
        ('"float[0]"', "neither a positive int nor a size name"),
        ('"float[heads"', 'must be "int", "float", "int[axes]", "float[axes]" or "bool[axes]"'),
        ('"double[heads]"', 'must be "int", "float", "int[axes]", "float[axes]" or "bool[axes]"'),
        ('"int[for]"', "neither a positive int nor a size name"),
        ('"int[99999999999]"', "neither a positive int nor a size name"),
        ("3", 'the type must be a string such as "int"'),
    ],
)
def test_bad_declarations_are_located(declared, message):
    shown = problems(f"t = {declared}", score="score")
    assert message in shown and "t.toml:" in shown


@pytest.mark.parametrize(
    "params, score, message",
    [
        ('t = "float[heads]"', "score + t", "`t` is a tensor: read one element"),
        ('t = "float[heads]"', "score + t[h, h]", "`t` has 1 axes, indexed with 2"),
        ('t = "float[heads]"', "score + t[0.5]", "an index needs an int, got float"),
        ('w = "int"', "score + w[h]", "`w` is a scalar param: it cannot be indexed"),
        ('t = "float[heads]"', "score + u[h] + t[h]", "`u` is not a tensor param"),
        ('t = "int[heads]"', "score + t[h] // 0", "division by zero"),
    ],
)
def test_bad_uses_are_located(params, score, message):
    shown = problems(params, score=score)
    assert message in shown and "^" in shown


def test_unused_tensor_is_reported():
    assert "declared but never used" in problems('t = "float[heads]"', score="score + 1.0")


def test_loads_clamp_each_index_into_its_axis():
    """The rule both kernels follow: an index below 0 reads element 0, past the end the last."""
    spec = spec_with('t = "float[heads, 5]"', score="score + t[h, q_idx - kv_idx]")
    table = np.arange(10, dtype=np.float32).reshape(2, 5)
    env = {"t": table, "h": np.array(1), "q_idx": np.arange(4)[:, None], "kv_idx": np.arange(4)[None, :]}
    got = evaluate(spec.score, {**env, "score": np.zeros(())})
    distance = np.arange(4)[:, None] - np.arange(4)[None, :]
    assert np.array_equal(got, table[1, np.clip(distance, 0, 4)])


def test_per_batch_prefix_gets_closed_form_bounds():
    spec = harness.spec_from_text(
        GOOD + '[mask]\nexpr = "kv_idx < prefix[b] or q_idx >= kv_idx"\n[params]\nprefix = "int[batch]"\n'
    )
    assert analyse_mask(spec.mask, {}, 16).affine


def test_masks_reading_positions_through_tensors_run_the_mask_on_every_tile():
    spec = harness.spec_from_text(
        GOOD
        + '[mask]\nexpr = "q_idx >= kv_idx and seg[b, q_idx] == seg[b, kv_idx]"\n[params]\nseg = "int[batch, q_len]"\n'
    )
    bounds = analyse_mask(spec.mask, {}, 16)
    assert not bounds.affine  # sound: visited tiles are PARTIAL, the causal bound still skips some


@settings(max_examples=60)
@given(
    prefix=st.lists(st.integers(-20, 140), min_size=1, max_size=3),
    q_len=st.integers(1, 130),
    kv_len=st.integers(1, 130),
    block_q=st.sampled_from([8, 16, 32]),
    block_kv=st.sampled_from([16, 32]),
)
def test_tile_classes_with_a_tensor_in_the_bounds_are_sound(prefix, q_len, kv_len, block_q, block_kv):
    """Tile classes computed with prefix[b] read from the tensor, against brute force."""
    spec = harness.spec_from_text(
        GOOD + '[mask]\nexpr = "kv_idx < prefix[b] or q_idx >= kv_idx"\n[params]\nprefix = "int[batch]"\n'
    )
    bounds = analyse_mask(spec.mask, {}, block_kv)
    table = np.array(prefix)
    for b in range(len(prefix)):
        env = {"prefix": table}
        got = classify(bounds, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, b=b, h=0, params=env)
        dense = evaluate(
            spec.mask,
            {"prefix": table, "b": b, "h": 0, "q_idx": np.arange(q_len)[:, None], "kv_idx": np.arange(kv_len)[None, :]},
        )
        want = brute_force(np.broadcast_to(dense, (q_len, kv_len)), block_q, block_kv)
        assert not ((got == EMPTY) & (want != EMPTY)).any() and not ((got == FULL) & (want != FULL)).any()


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_generated_functions_check_the_tensors(target):
    spec = spec_with('t = "float[heads, buckets]"\nu = "float[buckets]"', score="score + t[h, q_idx] + u[kv_idx]")
    module = harness.load_target(spec, target)
    if target == "triton_gpu":
        import torch

        make, options = torch.as_tensor, {}
    else:
        import jax.numpy as jnp

        make, options = jnp.asarray, {"interpret": True}
    q = make(np.ones((1, 2, 8, 64), np.float32))
    good = {"t": make(np.ones((2, 5), np.float32)), "u": make(np.ones(5, np.float32))}
    for bad, message in [
        ({"u": make(np.ones(6, np.float32))}, "buckets = 5"),  # a free size that differs between tensors
        ({"t": make(np.ones((3, 5), np.float32))}, "heads = 2"),
        ({"t": make(np.ones(5, np.float32))}, "must be a 2-D"),
        ({"u": make(np.ones(5, np.int32))}, "must be float32, float16 or bfloat16"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            module.attention(q, q, q, **{**good, **bad}, **options)


def test_reference_reads_each_head_its_own_row():
    """A per-head tensor changes heads independently (guards against a layout mix-up)."""
    spec = spec_with('slopes = "float[heads]"', score="score + slopes[h] * (kv_idx - q_idx)")
    p = harness.make_problem(spec, 1, 2, 16, 16, seed=3, params={"slopes": np.array([0.0, 0.5], np.float32)})
    out, _ = attention_ref(spec, p.q, p.k, p.v, **p.params)
    plain = harness.spec_from_text(GOOD)
    base, _ = attention_ref(plain, p.q, p.k, p.v)
    assert np.allclose(out[:, 0], base[:, 0]) and not np.allclose(out[:, 1], base[:, 1])


@pytest.mark.parametrize("target", ["triton", "pallas"])
def test_varlen_equals_attention_of_each_sequence(target):
    """specs/varlen.toml on a packed batch (the README's cu_seqlens recipe) equals causal
    bottom-right attention computed on each sequence alone, including sequences with more
    queries than keys (their first queries see nothing) and empty ones."""
    spec = harness.with_dtype(load_spec(ROOT / "specs" / "varlen.toml"), "float32")
    cu_q, cu_k = np.array([0, 5, 5, 40, 61], np.int32), np.array([0, 9, 12, 30, 75], np.int32)
    p = harness.make_problem(spec, 1, 2, 61, 75, seed=4, params=harness.varlen_params(cu_q, cu_k))
    out, lse = harness.TARGETS[target][0](spec, p)
    each = harness.spec_from_text(GOOD + '[mask]\ncausal = "bottom_right"\n')
    for (q0, q1), (k0, k1) in zip(itertools.pairwise(cu_q), itertools.pairwise(cu_k)):
        ref_out, ref_lse = attention_ref(each, p.q[:, :, q0:q1], p.k[:, :, k0:k1], p.v[:, :, k0:k1])
        np.testing.assert_allclose(out[:, :, q0:q1], ref_out, atol=2e-5)
        np.testing.assert_allclose(lse[:, :, q0:q1], ref_lse, atol=2e-5)


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_divisor_params_must_be_positive(target):
    """The tile analysis solves q_idx // chunk for chunk > 0; the functions refuse other values."""
    spec = load_spec(ROOT / "specs" / "chunked.toml")
    module = harness.load_target(spec, target)
    if target == "triton_gpu":
        import torch

        q, options = torch.ones((1, 1, 8, 128), dtype=torch.bfloat16), {}
    else:
        import jax.numpy as jnp

        q, options = jnp.ones((1, 1, 8, 128), jnp.bfloat16), {"interpret": True}
    with pytest.raises(ValueError, match="chunk divides in the spec's expressions: it must be positive, got 0"):
        module.attention(q, q, q, chunk=0, **options)
