"""Online-softmax numerics that only low precision exposes, on both targets.

A row that sees no key in its first PARTIAL tiles must keep its running max at -inf: were it
kept at 0, the row's later logits would be shifted by 0 instead of by their max, and with a
strongly negative score (a distance penalty) P falls into fp16's subnormal range before the
P.V product and loses its bits. Found on the H200 at q_len 3001, kv_len 2049 (row 2347, whose
only visible key is 2048); the same geometry at test size: with 64 x 64 tiles, row 427 sees only
key 128 (block 2) and nothing of block 1, which its q block visits first as a PARTIAL tile.
"""

import pytest

from attngen.spec import with_config
from tests import harness

SPEC = """
name = "penalised_window"
head_dim = 64
dtype = "float16"

[mask]
expr = "kv_idx <= q_idx + 3 and q_idx - kv_idx < 300"

[score]
expr = "score - 0.05 * abs(q_idx - kv_idx)"
"""
Q_LEN, KV_LEN = 448, 129


def _spec(target: str):
    spec = harness.spec_from_text(SPEC)
    if target == "triton":
        tiles = {f"{prefix}{key}": 64 for prefix in ("", "dq_", "dkdv_") for key in ("block_m", "block_n")}
        return with_config(spec, "triton_gpu", short_kv_len=0, **tiles)
    return with_config(spec, "pallas_tpu", block_q=64, block_kv=128)


@pytest.mark.parametrize("target", sorted(harness.TARGETS))
def test_rows_whose_first_tiles_are_empty_keep_their_bits_in_fp16(target):
    spec = _spec(target)
    run, run_grad = harness.TARGETS[target]
    p = harness.make_problem(spec, 1, 2, Q_LEN, KV_LEN, seed=3, params={})
    out, lse = run(spec, p)
    harness.assert_exact(spec, p, out, lse)
    c = harness.make_cotangents(p, seed=3)
    harness.assert_grads_exact(spec, p, c, run_grad(spec, p, c))
