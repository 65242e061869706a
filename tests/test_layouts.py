"""FlashAttention's layout, [batch, seq, heads, head_dim], on both targets: `layout="bshd"` gives
the same attention and gradients as the default layout, against the float64 reference, and the
same decoding from a KV cache (flash_attn_with_kvcache's layouts). On the Triton target q, k and v
are read in place, even sliced from one fused QKV projection, and the output is written in the
caller's layout (no copies)."""

import numpy as np
import pytest

from attngen.reference import attention_ref
from tests import harness
from tests.strategies import spec_toml

SPEC = spec_toml("kv_idx <= q_idx + 3", "score - 0.1 * abs(q_idx - kv_idx)", head_dim=32, extra=('dtype = "float32"',))
BATCH, SEQ, HEADS, KV_HEADS, DIM = 2, 37, 4, 2, 32


def _qkv_bshd(seed: int):
    """q [B, S, H, D]; k, v [B, S, H_kv, D], as slices of one fused projection [B, S, H + 2 H_kv, D]."""
    fused = np.random.default_rng(seed).standard_normal((BATCH, SEQ, HEADS + 2 * KV_HEADS, DIM)).astype(np.float32)
    return fused, (slice(0, HEADS), slice(HEADS, HEADS + KV_HEADS), slice(HEADS + KV_HEADS, None))


def test_triton_reads_and_writes_flashattentions_layout_in_place():
    import torch

    spec = harness.spec_from_text(SPEC)
    module = harness.load_target(spec, "triton_gpu")
    fused, parts = _qkv_bshd(seed=1)
    fused = torch.from_numpy(fused).requires_grad_()
    q, k, v = (fused[:, :, part] for part in parts)  # strided views of the projection
    out, lse = module.attention(q, k, v, layout="bshd", return_lse=True)
    assert out.shape == (BATCH, SEQ, HEADS, DIM) and out.is_contiguous()  # written in the caller's layout
    assert lse.shape == (BATCH, HEADS, SEQ)
    as_bhsd = [t.detach().transpose(1, 2).numpy() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(spec, *as_bhsd)
    np.testing.assert_allclose(out.detach().transpose(1, 2).numpy(), ref_out, atol=2e-5)
    np.testing.assert_allclose(lse.detach().numpy(), ref_lse, atol=2e-5)

    # Gradients reach the fused projection through the views, as the default layout's do.
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (grad,) = torch.autograd.grad(out, fused, dout)
    same = torch.from_numpy(fused.detach().numpy()).requires_grad_()
    bhsd = [same[:, :, part].transpose(1, 2) for part in parts]
    (expected,) = torch.autograd.grad(module.attention(*bhsd), same, dout.transpose(1, 2))
    np.testing.assert_allclose(grad.numpy(), expected.numpy(), atol=2e-5)


def test_triton_reads_a_strided_view_without_copying_it():
    import torch

    module = harness.load_target(harness.spec_from_text(SPEC), "triton_gpu")
    fused, parts = _qkv_bshd(seed=3)
    q = torch.from_numpy(fused)[:, :, parts[0]].transpose(1, 2)
    assert module._tma_ready(q) is q  # 16-byte aligned strides: the descriptor reads it as it is
    assert module._output_like(q).transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("axis", ["base", "batch", "heads", "seq"])
def test_triton_copies_a_view_that_tma_cannot_read(axis):
    """A base or a stride (a dim of size 1 too) off 16 bytes is copied contiguous, values kept."""
    import torch

    module = harness.load_target(harness.spec_from_text(SPEC), "triton_gpu")
    storage = torch.randn(2 * 3 * 40 * 36, generator=torch.Generator().manual_seed(5))  # room for longer strides
    sizes, strides = [1, 3, 40, DIM], [3 * 40 * 36, 40 * 36, 36, 1]  # rows padded to 36 floats: aligned
    offset = 1 if axis == "base" else 0  # one float: 4 bytes off
    if axis != "base":
        strides[["batch", "heads", "seq"].index(axis)] += 1  # 4 bytes more: off 16
    view = torch.as_strided(storage, sizes, strides, offset)
    ready = module._tma_ready(view)
    assert ready is not view and ready.is_contiguous() and torch.equal(ready, view)
    aligned = torch.as_strided(storage, sizes, [3 * 40 * 36, 40 * 36, 36, 1])
    assert module._tma_ready(aligned) is aligned


def test_pallas_takes_flashattentions_layout():
    import jax
    import jax.numpy as jnp

    spec = harness.spec_from_text(SPEC)
    module = harness.load_target(spec, "pallas_tpu")
    fused, parts = _qkv_bshd(seed=4)
    q, k, v = (jnp.asarray(fused[:, :, part]) for part in parts)
    out, lse = module.attention(q, k, v, layout="bshd", return_lse=True, interpret=True)
    assert out.shape == (BATCH, SEQ, HEADS, DIM) and lse.shape == (BATCH, HEADS, SEQ)
    ref_out, ref_lse = attention_ref(spec, *(np.swapaxes(np.asarray(t), 1, 2) for t in (q, k, v)))
    np.testing.assert_allclose(np.swapaxes(np.asarray(out), 1, 2), ref_out, atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-5)
    dq = jax.grad(lambda q: module.attention(q, k, v, layout="bshd", interpret=True).sum())(q)
    dq_bhsd = jax.grad(lambda q: module.attention(q, *(jnp.swapaxes(t, 1, 2) for t in (k, v)), interpret=True).sum())(
        jnp.swapaxes(q, 1, 2)
    )
    np.testing.assert_allclose(np.asarray(dq), np.swapaxes(np.asarray(dq_bhsd), 1, 2), atol=2e-5)


@pytest.mark.parametrize("target", harness.TARGETS)
def test_an_unknown_layout_is_refused(target):
    module = harness.load_target(harness.spec_from_text(SPEC), "triton_gpu" if target == "triton" else "pallas_tpu")
    q = np.zeros((1, 1, 4, DIM), np.float32)  # refused before any array is read
    with pytest.raises(ValueError, match="layout must be 'bhsd' or 'bshd', got 'sbhd'"):
        module.attention(q, q, q, layout="sbhd")


@pytest.mark.parametrize("target", harness.TARGETS)
@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_takes_flashattentions_layout(target, paged):
    """attention_with_kvcache(layout="bshd"): q [B, T, H, D], caches [B, S, H_kv, D] or pages
    [pages, page_size, H_kv, D], new k, v [B, T, H_kv, D], appended; the same output (in bshd) and
    caches as the default layout given the same arrays transposed."""
    rng = np.random.default_rng(5)
    batch, tokens, page_size, pages = 2, 3, 16, 4  # 64 keys a sequence
    draw = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    q, k_new, v_new = (
        draw(batch, tokens, HEADS, DIM),
        draw(batch, tokens, KV_HEADS, DIM),
        draw(batch, tokens, KV_HEADS, DIM),
    )
    rows = batch * pages if paged else batch
    k_cache, v_cache = (draw(rows, page_size if paged else pages * page_size, KV_HEADS, DIM) for _ in range(2))
    table = rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32) if paged else None
    lens = np.array([40, 13], np.int32)  # cached before the new tokens
    bhsd = lambda *arrays: [np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in arrays]
    if target == "triton":
        import torch

        module = harness.load_target(harness.spec_from_text(SPEC), "triton_gpu")

        def run(layout, q, k_cache, v_cache, k, v):
            caches = [torch.from_numpy(c.copy()) for c in (k_cache, v_cache)]
            out = module.attention_with_kvcache(
                torch.from_numpy(q), *caches, torch.from_numpy(lens), k=torch.from_numpy(k), v=torch.from_numpy(v),
                block_table=None if table is None else torch.from_numpy(table), layout=layout,
            )  # fmt: skip
            return out.numpy(), caches[0].numpy(), caches[1].numpy()
    else:
        import jax.numpy as jnp

        module = harness.load_target(harness.spec_from_text(SPEC), "pallas_tpu")

        def run(layout, q, k_cache, v_cache, k, v):
            results = module.attention_with_kvcache(
                *(jnp.asarray(x) for x in (q, k_cache, v_cache)), jnp.asarray(lens), k=jnp.asarray(k), v=jnp.asarray(v),
                block_table=None if table is None else jnp.asarray(table), layout=layout, interpret=True,
            )  # fmt: skip
            return tuple(np.asarray(x) for x in results)

    out, k_after, v_after = run("bshd", q, k_cache, v_cache, k_new, v_new)
    expected = run("bhsd", *bhsd(q, k_cache, v_cache, k_new, v_new))
    assert out.shape == q.shape and k_after.shape == k_cache.shape
    for got, want in zip((out, k_after, v_after), expected, strict=True):
        np.testing.assert_array_equal(np.swapaxes(got, 1, 2), want)
