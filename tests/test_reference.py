"""The oracle itself, checked against an independent implementation (torch SDPA in float64)."""

import numpy as np
import torch

from attngen import ir
from attngen.reference import attention_ref, evaluate
from attngen.spec import parse_spec


def test_matches_torch_sdpa_in_float64():
    spec = parse_spec('name = "x"\nhead_dim = 32\n[mask]\nexpr = "q_idx >= kv_idx and kv_idx > 3"\n', "s.toml")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, n, 32)) for n in (50, 40, 40))
    out, lse = attention_ref(spec, q, k, v, scale=0.3)
    visible = np.arange(50)[:, None] >= np.arange(40)[None, :]
    visible &= np.arange(40)[None, :] > 3
    rows = visible.any(axis=1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(visible), scale=0.3
    ).numpy()
    np.testing.assert_allclose(out[:, :, rows], expected[:, :, rows], rtol=1e-12, atol=1e-12)
    assert (out[:, :, ~rows] == 0).all() and np.isneginf(lse[:, :, ~rows]).all()
    logits = 0.3 * np.einsum("bhqd,bhkd->bhqk", q, k)
    expected_lse = np.log(np.where(visible, np.exp(logits), 0).sum(-1))
    np.testing.assert_allclose(lse[:, :, rows], expected_lse[:, :, rows], rtol=1e-12)


def test_integer_division_floors():
    spec = parse_spec(
        'name = "x"\nhead_dim = 32\n[mask]\nexpr = "(q_idx - kv_idx) // 4 == -1 and (q_idx - kv_idx) % 4 == 1"\n',
        "s.toml",
    )
    value = evaluate(spec.mask, {"q_idx": np.array(0), "kv_idx": np.array(3)})
    assert bool(value)  # -3 // 4 == -1 and -3 % 4 == 1, as in Python
    assert evaluate(ir.Arith(ir.Type.INT, "//", ir.Const(ir.Type.INT, -7), ir.Const(ir.Type.INT, 2)), {}) == -4
