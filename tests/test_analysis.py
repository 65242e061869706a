"""Tile analysis against brute force on dense masks."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen.analysis import analyse_mask
from attngen.reference import dense_mask, evaluate
from tests import harness
from tests.strategies import INT_PARAM, masks, spec_toml

EMPTY, PARTIAL, FULL = 0, 1, 2


def classify(bounds, *, q_len, kv_len, block_q, block_kv, b, h, params) -> np.ndarray:
    """[q blocks, kv blocks] classes as the kernels see them, from the emitted bound IR."""
    nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
    classes = np.full((nq, nk), EMPTY)
    for qb in range(nq):
        env = {
            "q_first": qb * block_q,
            "q_last": min(qb * block_q + block_q, q_len) - 1,
            "kv_len": kv_len,
            "q_len": q_len,
            "b": b,
            "h": h,
            **params,
        }
        for name, field in (("kv_lo", "lo"), ("kv_hi", "hi"), ("full_lo", "full_lo"), ("full_hi", "full_hi")):
            env[name] = int(evaluate(getattr(bounds, field), env))
        classes[qb, env["kv_lo"] : env["kv_hi"]] = PARTIAL
        classes[qb, env["full_lo"] : env["full_hi"]] = FULL
        assert env["kv_lo"] <= env["full_lo"] or env["full_lo"] == env["full_hi"]
        assert env["full_hi"] <= max(env["kv_hi"], env["full_lo"])
    return classes


def brute_force(dense: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    q_len, kv_len = dense.shape
    nq, nk = -(-q_len // block_q), -(-kv_len // block_kv)
    classes = np.empty((nq, nk), dtype=int)
    for i in range(nq):
        for j in range(nk):
            tile = dense[i * block_q : (i + 1) * block_q, j * block_kv : (j + 1) * block_kv]
            classes[i, j] = FULL if tile.all() else (EMPTY if not tile.any() else PARTIAL)
    return classes


def mask_spec(mask: str):
    return harness.spec_from_text(spec_toml(mask))


@settings(max_examples=60)
@given(
    mask=masks(max_depth=3),
    q_len=st.integers(1, 260),
    kv_len=st.integers(1, 260),
    block_q=st.sampled_from([8, 16, 32, 64]),
    block_kv=st.sampled_from([16, 32, 64]),
    w=st.integers(-50, 300),
    b=st.integers(0, 2),
    h=st.integers(0, 3),
)
def test_classification_is_sound(mask, q_len, kv_len, block_q, block_kv, w, b, h):
    """EMPTY and FULL are never claimed wrongly; the kv tail block is never FULL."""
    spec = mask_spec(mask)
    params = {p.name: w for p in spec.params}
    bounds = analyse_mask(spec.mask, {p.name: p.type for p in spec.params}, block_kv)
    ours = classify(bounds, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, b=b, h=h, params=params)
    dense = dense_mask(spec, b + 1, h + 1, q_len, kv_len, params)[b, h]
    truth = brute_force(dense, block_q, block_kv)
    assert not ((ours == EMPTY) & (truth != EMPTY)).any(), "a tile with visible keys is skipped"
    assert not ((ours == FULL) & (truth != FULL)).any(), "a tile with hidden keys runs unmasked"
    if kv_len % block_kv:
        assert (ours[:, -1] != FULL).all()


BAND_MASKS = [
    "q_idx >= kv_idx",
    f"q_idx >= kv_idx and q_idx - kv_idx < {INT_PARAM}",
    f"kv_idx < {INT_PARAM} or q_idx >= kv_idx",
    f"q_idx - kv_idx <= {INT_PARAM} and kv_idx - q_idx <= {INT_PARAM}",
    f"kv_idx >= {INT_PARAM}",
    f"q_idx < {INT_PARAM}",
    "q_idx + kv_len - q_len >= kv_idx",  # causal, bottom-right aligned
    f"q_idx + kv_len - q_len >= kv_idx and q_idx + kv_len - q_len - kv_idx < {INT_PARAM}",
]


@settings(max_examples=150)
@given(
    mask=st.sampled_from(BAND_MASKS),
    q_len=st.integers(1, 300),
    kv_len=st.integers(1, 300),
    block_q=st.sampled_from([8, 16, 32, 64]),
    block_kv=st.sampled_from([16, 32, 64]),
    w=st.integers(0, 300),
)
def test_band_masks_are_tight(mask, q_len, kv_len, block_q, block_kv, w):
    """For causal, windows and prefixes the bounds are exact: EMPTY and FULL tiles are all found,
    except the kv tail block, which runs masked by design, and q blocks that see no key at all,
    which may visit one kv block (an empty key interval narrower than a block)."""
    spec = mask_spec(mask)
    params = {p.name: w for p in spec.params}
    bounds = analyse_mask(spec.mask, {p.name: p.type for p in spec.params}, block_kv)
    assert bounds.affine
    ours = classify(bounds, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, b=0, h=0, params=params)
    truth = brute_force(dense_mask(spec, 1, 1, q_len, kv_len, params)[0, 0], block_q, block_kv)
    if kv_len % block_kv:
        truth[:, -1] = np.minimum(truth[:, -1], PARTIAL)
    blind = (truth == EMPTY).all(axis=1)
    assert ((ours[blind] != EMPTY).sum(axis=1) <= 1).all()
    np.testing.assert_array_equal(ours[~blind], truth[~blind])


def test_unboundable_terms_are_reported():
    spec = mask_spec("q_idx >= kv_idx and (q_idx - kv_idx) % 3 == 0")
    assert not analyse_mask(spec.mask, {}, 64).affine
    assert analyse_mask(mask_spec("q_idx >= kv_idx").mask, {}, 64).affine


CHUNKED_MASKS = [  # INT_PARAM is the chunk
    f"q_idx // {INT_PARAM} == kv_idx // {INT_PARAM}",
    f"q_idx // {INT_PARAM} == kv_idx // {INT_PARAM} and q_idx >= kv_idx",  # Llama 4's chunked attention
    f"(q_idx + 3) // {INT_PARAM} <= kv_idx // {INT_PARAM}",
]


@settings(max_examples=150)
@given(
    mask=st.sampled_from(CHUNKED_MASKS),
    q_len=st.integers(1, 300),
    kv_len=st.integers(1, 300),
    block_q=st.sampled_from([8, 16, 32, 64]),
    block_kv=st.sampled_from([16, 32, 64]),
    chunk=st.integers(1, 300),
)
def test_chunked_masks_are_tight(mask, q_len, kv_len, block_q, block_kv, chunk):
    """Floors of the key position are solved exactly (floor(k / c) <= r <=> k <= c r + c - 1), so
    chunked masks get closed-form bounds as tight as the band masks'."""
    spec = mask_spec(mask)
    bounds = analyse_mask(spec.mask, {INT_PARAM: spec.params[0].type}, block_kv)
    assert bounds.affine
    params = {INT_PARAM: chunk}
    ours = classify(bounds, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, b=0, h=0, params=params)
    truth = brute_force(dense_mask(spec, 1, 1, q_len, kv_len, params)[0, 0], block_q, block_kv)
    if kv_len % block_kv:
        truth[:, -1] = np.minimum(truth[:, -1], PARTIAL)
    blind = (truth == EMPTY).all(axis=1)
    assert ((ours[blind] != EMPTY).sum(axis=1) <= 1).all()
    np.testing.assert_array_equal(ours[~blind], truth[~blind])
