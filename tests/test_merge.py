"""merge_partials, on both targets: attention over two disjoint key sets, merged through their LSEs,
equals attention over all keys (the building block of context-parallel attention)."""

import numpy as np
import pytest

from attngen.reference import attention_ref
from tests import harness
from tests.strategies import spec_toml


def _merge(target, spec, parts):
    """merge_partials of the target's generated module, on (out, lse) numpy pairs."""
    module = harness.load_target(spec, "triton_gpu" if target == "triton" else "pallas_tpu")
    if target == "triton":
        import torch

        args = [torch.from_numpy(np.ascontiguousarray(x)) for part in parts for x in part]
        return [x.numpy() for x in module.merge_partials(*args)]
    import jax.numpy as jnp

    return [np.asarray(x) for x in module.merge_partials(*(jnp.asarray(x) for part in parts for x in part))]


@pytest.mark.parametrize("target", harness.TARGETS)
@pytest.mark.parametrize("split", [30, 0], ids=["halves", "one-part-empty"])
def test_merging_two_key_shards_is_exact(target, split):
    run, _ = harness.TARGETS[target]
    spec = harness.spec_from_text(spec_toml(None, "score + 0.5", head_dim=32, extra=('dtype = "float32"',)))
    p = harness.make_problem(spec, 2, 2, 20, 50, seed=4, params={})
    parts = []
    for keys in (slice(0, split), slice(split, None)):
        shard = harness.Problem(p.q, p.k[:, :, keys], p.v[:, :, keys], p.dtype, None, {})
        parts.append(run(spec, shard))
    out, lse = _merge(target, spec, parts)
    ref_out, ref_lse = attention_ref(spec, p.q, p.k, p.v)
    np.testing.assert_allclose(out, ref_out, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)


@pytest.mark.parametrize("target", harness.TARGETS)
def test_rows_empty_in_both_parts_stay_empty(target):
    spec = harness.spec_from_text(spec_toml(None, head_dim=32, extra=('dtype = "float32"',)))
    empty = (np.zeros((1, 1, 3, 32), np.float32), np.full((1, 1, 3), -np.inf, np.float32))
    out, lse = _merge(target, spec, [empty, empty])
    assert (out == 0).all() and np.isneginf(lse).all()
