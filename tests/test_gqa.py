"""Grouped-query and multi-query attention (k and v with fewer heads than q), on both targets:
query head h reads kv head h // (heads // kv_heads) with no copy of K or V, and the backward sums
dK and dV over each group. The mask and score read `h`, so a wrong head mapping shows."""

import pytest

from tests import harness
from tests.strategies import spec_toml

TILES = "[triton]\nblock_m = 16\nblock_n = 16\ndq_block_m = 16\ndq_block_n = 32\ndkdv_block_m = 32\ndkdv_block_n = 16\n"
TILES += "[pallas_tpu]\nblock_q = 16\nblock_kv = 128\n"


@pytest.mark.parametrize("target", harness.TARGETS)
@pytest.mark.parametrize(
    ("dtype", "heads", "kv_heads", "q_len", "kv_len"),
    [("float32", 4, 2, 45, 37), ("float32", 3, 1, 33, 50), ("bfloat16", 4, 1, 40, 40)],
    ids=["gqa", "mqa", "mqa-bf16"],
)
def test_grouped_heads(target, dtype, heads, kv_heads, q_len, kv_len):
    run, run_grad = harness.TARGETS[target]
    text = spec_toml("q_idx + 3 * h >= kv_idx", "score - 0.25 * h", head_dim=32, extra=(f'dtype = "{dtype}"',))
    spec = harness.spec_from_text(text + TILES)
    p = harness.make_problem(spec, 2, heads, q_len, kv_len, seed=heads + kv_heads, params={}, kv_heads=kv_heads)
    assert p.k.shape[1] == kv_heads
    harness.assert_exact(spec, p, *run(spec, p))
    c = harness.make_cotangents(p, seed=1)
    dq, dk, dv = run_grad(spec, p, c)
    assert dk.shape == p.k.shape and dv.shape == p.v.shape
    harness.assert_grads_exact(spec, p, c, (dq, dk, dv))


@pytest.mark.parametrize("target", harness.TARGETS)
def test_heads_that_do_not_divide_are_refused(target):
    run, _ = harness.TARGETS[target]
    spec = harness.spec_from_text(spec_toml("causal", head_dim=32))
    p = harness.make_problem(spec, 1, 3, 8, 8, seed=0, params={}, kv_heads=2)
    with pytest.raises(ValueError, match="kv heads dividing q heads"):
        run(spec, p)


@pytest.mark.parametrize(("sms", "parts"), [(1, 1), (3, 2), (10**6, 4)], ids=["whole-groups", "halves", "per-head"])
def test_triton_splits_groups_over_programs(sms, parts, monkeypatch):
    """With few kv heads the Triton dK/dV kernel splits each group of query heads over programs, which
    write float32 partial sums; the grid here has 2 batches x 1 kv head x 3 kv blocks = 6 programs,
    so `sms` SMs (4 programs each) ask for `parts` parts of the 4-head group."""
    text = spec_toml("q_idx + 3 * h >= kv_idx", "score - 0.25 * h", head_dim=32, extra=('dtype = "float32"',))
    spec = harness.spec_from_text(text + TILES)
    module = harness.load_target(spec, "triton_gpu")
    monkeypatch.setattr(module, "_sm_count", lambda device: sms)
    assert module._group_splits(4, 6, None) == parts
    p = harness.make_problem(spec, 2, 4, 40, 40, seed=parts, params={}, kv_heads=1)
    c = harness.make_cotangents(p, seed=parts)
    harness.assert_grads_exact(spec, p, c, harness.run_triton_grad(spec, p, c))
