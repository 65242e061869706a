"""Our Pallas kernels against jax's own TPU kernels (flash_attention, splash attention,
paged_attention) where the variants coincide: same inputs, TPU interpret mode, forward and
gradients; and all of them through the real Mosaic compile for TPU v5e at the same shapes."""

import functools

import numpy as np
import pytest

from attngen.spec import load_spec, with_config
from tests import harness

LENGTH, HEADS, HEAD_DIM, WINDOW, SOFTCAP = 512, 2, 128, 100, 20.0
# spec -> (params, splash mask factory, splash soft cap)
CASES = {
    "causal": ({}, "causal", None),
    "sliding_window": ({"window": WINDOW}, "local", None),
    "softcap": ({"softcap": SOFTCAP}, "causal", SOFTCAP),
}


def _splash(mask_kind, soft_cap, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    shape = (LENGTH, LENGTH)
    one = (
        masks.CausalMask(shape)
        if mask_kind == "causal"
        else masks.LocalMask(shape, window_size=(WINDOW - 1, 0), offset=0)
    )
    sizes = splash.BlockSizes(
        block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
        block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128,
    )  # fmt: skip
    kernel = splash.make_splash_mha(
        masks.MultiHeadMask([one] * HEADS), block_sizes=sizes, head_shards=1, q_seq_shards=1,
        attn_logits_soft_cap=soft_cap, interpret=interpret,
    )  # fmt: skip
    return kernel


def _ours(name):
    spec = harness.with_dtype(load_spec(f"specs/{name}.toml"), "float32")
    spec = with_config(spec, "pallas_tpu", block_q=128, block_kv=128)
    return harness.load_target(spec, "pallas_tpu")


def _inputs():
    import jax.numpy as jnp

    rng = np.random.default_rng(2026)
    return [jnp.asarray(rng.standard_normal((1, HEADS, LENGTH, HEAD_DIM)), jnp.float32) for _ in range(4)]


@pytest.mark.parametrize("name", CASES)
def test_agrees_with_splash_attention(name):
    import jax
    from jax.experimental.pallas import tpu as pltpu

    params, mask_kind, soft_cap = CASES[name]
    q, k, v, dout = _inputs()
    scale = 1 / np.sqrt(HEAD_DIM)
    interpret = pltpu.InterpretParams()
    ours = functools.partial(_ours(name).attention, interpret=interpret, **params)
    splash = _splash(mask_kind, soft_cap, interpret=True)

    def theirs(q, k, v):  # splash takes pre-scaled q, one batch element at a time
        return jax.vmap(splash)(q * scale, k, v)

    out, vjp = jax.vjp(ours, q, k, v)
    ref_out, ref_vjp = jax.vjp(theirs, q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=0)
    for ours_grad, their_grad in zip(vjp(dout), ref_vjp(dout)):
        np.testing.assert_allclose(ours_grad, their_grad, atol=1e-4, rtol=0)


def test_decode_agrees_with_paged_attention():
    """attention_with_kvcache of spec causal against jax's paged_attention on what it covers: one
    new token per sequence, a paged cache, GQA (8 query heads on 2 kv heads), lengths that end
    inside a page and inside a compute block. Its kernel casts K and V to bfloat16 whatever they
    are, so the inputs are bfloat16, and the scale a power of two (it takes q pre-scaled, exactly).
    It keeps p in float32 for p @ v where ours rounds p to bfloat16 (as FlashAttention does): the
    two agree to one bfloat16 step of the output, and each is within one step of the float64
    reference (the output's own rounding is half a step)."""
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    from attngen.exactness import round_to
    from attngen.reference import attention_ref

    batch, heads, kv_heads, page_size, pages_per_sequence, scale = 3, 8, 2, 16, 16, 0.125
    rng = np.random.default_rng(2027)

    def draw(*shape):
        return round_to(rng.standard_normal(shape).astype(np.float32), "bfloat16")

    num_pages = batch * pages_per_sequence + 3
    q, k_pages, v_pages = draw(batch, heads, HEAD_DIM), *(draw(num_pages, kv_heads, page_size, HEAD_DIM) for _ in "kv")
    table = rng.permutation(num_pages)[: batch * pages_per_sequence].reshape(batch, -1).astype(np.int32)
    lengths = np.array([256, 77, 130], np.int32)
    bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    spec = with_config(harness.with_dtype(load_spec("specs/causal.toml"), "bfloat16"), "pallas_tpu", block_kv=128)
    ours = harness.load_target(spec, "pallas_tpu").attention_with_kvcache(
        bf16(q[:, :, None]), bf16(k_pages), bf16(v_pages), jnp.asarray(lengths),
        block_table=jnp.asarray(table), scale=scale, interpret=pltpu.InterpretParams(),
    )[:, :, 0]  # fmt: skip
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):  # its pages: [kv_heads, num_pages, ...]
        theirs = paged_attention(
            bf16(q * scale), bf16(k_pages.transpose(1, 0, 2, 3)), bf16(v_pages.transpose(1, 0, 2, 3)),
            jnp.asarray(lengths), jnp.asarray(table), pages_per_compute_block=8,
        )  # fmt: skip
    ours, theirs = (np.asarray(x.astype(jnp.float32)) for x in (ours, theirs))
    step = 2.0**-8  # a bfloat16 step in [0.5, 1): the outputs are averages of unit normals
    np.testing.assert_allclose(ours, theirs, atol=step, rtol=0)
    for b, length in enumerate(lengths):
        # The sequence's keys and values [1, kv_heads, length, D], read through its pages.
        k_seq, v_seq = (np.concatenate(list(pages[table[b]]), axis=1)[None, :, :length] for pages in (k_pages, v_pages))
        q_seq = draw(1, heads, length, HEAD_DIM)
        q_seq[0, :, -1] = q[b]
        ref, _ = attention_ref(spec, q_seq, k_seq, v_seq, scale=scale)
        for out in (ours, theirs):
            np.testing.assert_allclose(out[b], ref[0, :, -1], atol=step, rtol=0)


@pytest.mark.parametrize("spec_name, window", [("causal", None), ("sliding_window", 40)])
def test_ragged_decode_agrees_with_ragged_paged_attention(spec_name, window):
    """attention_with_kvcache with cu_seqlens_q against jax's ragged paged attention (vLLM's mixed
    batches on TPU) on what it covers: a 12-token chunk, one decoding token and five speculative
    ones, causal or a sliding window, over 16-token pages in FlashAttention's layout (its pages hold
    K and V heads interleaved), GQA 8 -> 2. Its kernel does not run in this jax's interpret modes
    (its multi-page DMAs fail in both), so the peer is its own reference, ref_ragged_paged_attention:
    its positions and window. bfloat16 and a power-of-two scale, as above: the two agree to one
    bfloat16 step, and each is within one step of the float64 reference (relative past 1: a row of
    few keys averages few values)."""
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import ref_ragged_paged_attention

    from attngen.exactness import round_to
    from attngen.reference import attention_ref

    heads, kv_heads, page_size, pages_per_sequence, scale = 8, 2, 16, 16, 0.125
    tokens, lengths = [12, 1, 5], np.array([200, 77, 130], np.int32)
    batch, cu = len(tokens), np.cumsum([0, *tokens], dtype=np.int32)
    rng = np.random.default_rng(2028)

    def draw(*shape):
        return round_to(rng.standard_normal(shape).astype(np.float32), "bfloat16")

    num_pages = batch * pages_per_sequence + 3
    q, k_pages, v_pages = draw(cu[-1], heads, HEAD_DIM), *(draw(num_pages, page_size, kv_heads, HEAD_DIM) for _ in "kv")
    kv_pages = np.stack([k_pages, v_pages], axis=3).reshape(num_pages, page_size, 2 * kv_heads, HEAD_DIM)
    table = rng.permutation(num_pages)[: batch * pages_per_sequence].reshape(batch, -1).astype(np.int32)
    bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    spec = with_config(harness.with_dtype(load_spec(f"specs/{spec_name}.toml"), "bfloat16"), "pallas_tpu", block_kv=128)
    ours = harness.load_target(spec, "pallas_tpu").attention_with_kvcache(
        bf16(q), bf16(k_pages), bf16(v_pages), jnp.asarray(lengths), block_table=jnp.asarray(table),
        cu_seqlens_q=jnp.asarray(cu), layout="bshd", scale=scale, interpret=pltpu.InterpretParams(),
        **({} if window is None else {"window": window}),
    )  # fmt: skip
    theirs = ref_ragged_paged_attention(
        bf16(q), bf16(kv_pages), jnp.asarray(lengths), jnp.asarray(table), jnp.asarray(cu),
        jnp.asarray([batch], jnp.int32), sm_scale=scale, sliding_window=window,
    )  # fmt: skip
    ours, theirs = (np.asarray(x.astype(jnp.float32)) for x in (ours, theirs))
    # A bfloat16 step: 2^-8 in [0.5, 1), and relative past 1 (a row of few keys averages few values).
    step, relative_step = 2.0**-8, 2.0**-7
    np.testing.assert_allclose(ours, theirs, atol=step, rtol=relative_step)
    params = {} if window is None else {"window": window}
    for b, length in enumerate(lengths):
        # The sequence's keys and values [1, kv_heads, length, D], read through its pages.
        k_seq, v_seq = (
            np.concatenate(list(pages[table[b]]), axis=0).transpose(1, 0, 2)[None, :, :length]
            for pages in (k_pages, v_pages)
        )
        q_seq = draw(1, heads, length, HEAD_DIM)
        q_seq[0, :, length - tokens[b] :] = q[cu[b] : cu[b + 1]].transpose(1, 0, 2)
        ref, _ = attention_ref(spec, q_seq, k_seq, v_seq, scale=scale, **params)
        for out in (ours, theirs):
            np.testing.assert_allclose(
                out[cu[b] : cu[b + 1]],
                ref[0, :, length - tokens[b] :].transpose(1, 0, 2),
                atol=step,
                rtol=relative_step,
            )


def _flash_blocks():
    from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

    return jax_flash.BlockSizes(
        block_q=128, block_k_major=128, block_k=128, block_b=1, block_q_major_dkv=128, block_k_major_dkv=128,
        block_k_dkv=128, block_q_dkv=128, block_k_major_dq=128, block_k_dq=128, block_q_dq=128,
    )  # fmt: skip


_FLASH_BLOCKS = _flash_blocks()


def test_agrees_with_flash_attention_causal():
    import jax
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

    q, k, v, dout = _inputs()
    scale = 1 / np.sqrt(HEAD_DIM)
    ours = functools.partial(_ours("causal").attention, interpret=pltpu.InterpretParams())
    sizes = _FLASH_BLOCKS
    out, vjp = jax.vjp(ours, q, k, v)
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
        theirs = functools.partial(jax_flash.flash_attention, causal=True, sm_scale=scale, block_sizes=sizes)
        ref_out, ref_vjp = jax.vjp(theirs, q, k, v)
        their_grads = ref_vjp(dout)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=0)
    for ours_grad, their_grad in zip(vjp(dout), their_grads):
        np.testing.assert_allclose(ours_grad, their_grad, atol=1e-4, rtol=0)


def test_all_compile_for_tpu_v5e():
    """Ours, splash and flash_attention, forward and backward, through Mosaic for v5e at the
    same shapes (bf16)."""
    import jax
    import jax.numpy as jnp

    from attngen.check.tpu import TPU_TARGETS, _device

    device = _device(TPU_TARGETS["tpu-v5e"])
    assert device is not None, "libtpu is not installed"
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((1, HEADS, LENGTH, HEAD_DIM), jnp.bfloat16, sharding=sharding)
    spec = with_config(load_spec("specs/causal.toml"), "pallas_tpu", block_q=128, block_kv=128)
    ours = harness.load_target(spec, "pallas_tpu").attention
    splash = _splash("causal", None, interpret=False)
    from jax.experimental.pallas.ops.tpu import flash_attention as jax_flash

    candidates = {
        "ours": lambda q, k, v: ours(q, k, v),
        "splash": lambda q, k, v: jax.vmap(splash)(q, k, v),
        "flash_attention": lambda q, k, v: jax_flash.flash_attention(q, k, v, causal=True, block_sizes=_FLASH_BLOCKS),
    }
    for fn in candidates.values():

        def loss(q, k, v, fn=fn):
            return jnp.sum(fn(q, k, v).astype(jnp.float32))

        with jax.default_device(device):
            jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(lowering_platforms=("tpu",)).compile()
