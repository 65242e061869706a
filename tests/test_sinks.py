"""Attention sinks (gpt-oss): one logit per batch and head in every row's softmax denominator, with
no value. Forward, gradients (the sink param's included) and decoding from a KV cache, on both
targets, against float64 autograd of the reference; the spec's checks of a [sink] expr."""

import numpy as np
import pytest
import torch

from attngen import ir
from attngen.errors import SpecError
from attngen.exactness import assert_forward, assert_grads
from attngen.reference import attention_ref_torch
from tests import harness

SINKS = """name = "sinks"
head_dim = 32
dtype = "float32"

[mask]
expr = "kv_idx <= q_idx - 2 and q_idx - kv_idx < window"

[params]
window = "int"
sinks = "float[{axes}]"

[sink]
expr = "{expr}"

[triton]
block_m = 16
block_n = 16

[pallas_tpu]
block_q = 128
block_kv = 128
"""


def sinks_spec(axes="heads", expr="sinks[h]", score=None):
    text = SINKS.format(axes=axes, expr=expr)
    if score:
        text = text.replace("[sink]", f'[score]\nexpr = "{score}"\n\n[sink]')
    return harness.spec_from_text(text)


def inputs(batch, heads, kv_heads, q_len, kv_len, axes, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, q_len, 32, generator=g)
    k, v = (torch.randn(batch, kv_heads, kv_len, 32, generator=g) for _ in range(2))
    shape = (heads,) if axes == "heads" else (batch, heads)
    sinks = 2 * torch.randn(shape, generator=g)
    cotangents = torch.randn(batch, heads, q_len, 32, generator=g), torch.randn(batch, heads, q_len, generator=g)
    return q, k, v, sinks, cotangents


def torch_grads(fn, q, k, v, sinks, cotangents, dtype=torch.float32, sink_grad=True):
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)] + [sinks.to(dtype).requires_grad_(sink_grad)]
    out, lse = fn(*leaves)
    dout, dlse = cotangents
    loss = (out * dout.to(out.dtype)).sum() + (lse * dlse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves[: 3 + sink_grad], allow_unused=True, materialize_grads=True)
    return out.detach(), lse.detach(), [*grads, torch.zeros_like(sinks)][:4]


def reference(spec, q, k, v, sinks, cotangents, window):
    return torch_grads(
        lambda q, k, v, s: attention_ref_torch(spec, q, k, v, window=window, sinks=s),
        q, k, v, sinks, cotangents, torch.float64,
    )  # fmt: skip


def run_triton(spec, q, k, v, sinks, cotangents, window):
    module = harness.load_target(spec, "triton_gpu")
    return torch_grads(
        lambda q, k, v, s: module.attention(q, k, v, window=window, sinks=s, return_lse=True),
        q, k, v, sinks, cotangents, sink_grad=isinstance(spec.sink, ir.Load),  # a sink read as it is: its param learns
    )  # fmt: skip


def run_pallas(spec, q, k, v, sinks, cotangents, window):
    import jax
    import jax.numpy as jnp

    module = harness.load_target(spec, "pallas_tpu")
    dout, dlse = (jnp.asarray(c.numpy()) for c in cotangents)

    def loss(q, k, v, s):
        out, lse = module.attention(q, k, v, window=window, sinks=s, return_lse=True, interpret=True)
        return (out * dout).sum() + (lse * dlse).sum(), (out, lse)

    args = [jnp.asarray(x.numpy()) for x in (q, k, v, sinks)]
    grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
    as_torch = lambda x: torch.from_numpy(np.asarray(x))
    return as_torch(out), as_torch(lse), [as_torch(g) for g in grads]


RUN = {"triton": run_triton, "pallas": run_pallas}


@pytest.mark.parametrize("target", sorted(RUN))
@pytest.mark.parametrize(
    "axes, expr, score, shape",
    [
        ("heads", "sinks[h]", None, (2, 4, 2, 70, 90)),  # GQA; rows 0 and 1 see no key
        ("batch, heads", "sinks[b, h]", None, (2, 2, 2, 40, 40)),
        ("heads", "sinks[h]", "score * 0.5 + 1.0", (1, 2, 1, 33, 65)),  # natural-unit logits
        ("heads", "0.5 * sinks[h] - 1.0", None, (1, 2, 2, 30, 30)),  # an expression: no gradient
    ],
)
def test_forward_and_gradients_against_float64(target, axes, expr, score, shape):
    spec = sinks_spec(axes, expr, score)
    q, k, v, sinks, cotangents = inputs(*shape, axes, seed=len(expr))
    window = 25
    out, lse, grads = RUN[target](spec, q, k, v, sinks, cotangents, window)
    ref_out, ref_lse, ref_grads = reference(spec, q, k, v, sinks, cotangents, window)
    assert_forward("float32", out, lse, ref_out, ref_lse)
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2])), "rows with no key give 0"
    assert_grads("float32", grads[:3], ref_grads[:3])
    if expr.startswith("sinks["):
        assert_grads("float32", {"dsinks": grads[3]}, {"dsinks": ref_grads[3]})
    else:  # the sink is an expression of the param: the param gets no gradient
        assert not grads[3].any()


@pytest.mark.parametrize("target", sorted(RUN))
def test_no_keys_gives_the_sink_as_lse(target):
    spec = sinks_spec()
    q, k, v, sinks, cotangents = inputs(1, 2, 2, 5, 0, "heads", seed=3)
    out, lse, grads = RUN[target](spec, q, k, v, sinks, cotangents, 4)
    assert not out.any()
    torch.testing.assert_close(lse, sinks[None, :, None].expand_as(lse))
    # d lse / d sink = 1 for each row; nothing else depends on the sink.
    torch.testing.assert_close(grads[3], cotangents[1].sum((0, 2)))


def test_the_sink_gradient_is_deterministic():
    spec = sinks_spec()
    q, k, v, sinks, cotangents = inputs(2, 4, 1, 64, 80, "heads", seed=5)
    first = run_triton(spec, q, k, v, sinks, cotangents, 30)[2]
    second = run_triton(spec, q, k, v, sinks, cotangents, 30)[2]
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("target", sorted(RUN))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decoding_from_a_cache_adds_the_sink_once(target, num_splits):
    """The new tokens against a cache: the sink joins each row once, also when the keys are split."""
    spec = sinks_spec()
    batch, heads, kv_heads, new_tokens, capacity = 2, 4, 2, 3, 96
    q, k, v, sinks, _ = inputs(batch, heads, kv_heads, new_tokens, capacity, "heads", seed=7)
    lens = torch.tensor([96, 41], dtype=torch.int32)
    window = 20
    if target == "triton":
        module = harness.load_target(spec, "triton_gpu")
        out, lse = module.attention_with_kvcache(
            q, k, v, lens, window=window, sinks=sinks, return_lse=True, num_splits=num_splits
        )
    else:
        import jax.numpy as jnp

        module = harness.load_target(spec, "pallas_tpu")
        out, lse = module.attention_with_kvcache(
            *(jnp.asarray(x.numpy()) for x in (q, k, v, lens)), window=window, sinks=jnp.asarray(sinks.numpy()),
            return_lse=True, interpret=True,
        )  # fmt: skip
        out, lse = (torch.from_numpy(np.asarray(x)) for x in (out, lse))
    for b, length in enumerate(lens.tolist()):
        # The cached sequence's last new_tokens positions as queries of the training reference.
        rows = torch.zeros(1, heads, length, 32)
        rows[:, :, length - new_tokens :] = q[b : b + 1]
        ref_out, ref_lse = attention_ref_torch(
            spec, rows.double(), k[b : b + 1, :, :length].double(), v[b : b + 1, :, :length].double(),
            window=window, sinks=sinks.double(),
        )  # fmt: skip
        tail = slice(length - new_tokens, length)
        assert_forward("float32", out[b : b + 1], lse[b : b + 1], ref_out[:, :, tail], ref_lse[:, :, tail])


@pytest.mark.parametrize(
    "expr, message",
    [
        ("sinks[h] + q_idx", "reads q_idx: a sink is one logit per batch and head"),
        ("sinks[h] > 0.0", "float"),
    ],
)
def test_a_sink_reads_batch_head_and_params_only(expr, message):
    with pytest.raises(SpecError, match=message):
        sinks_spec(expr=expr)


def test_a_param_only_the_sink_reads_is_used():
    spec = sinks_spec()
    assert [p.name for p in spec.params] == ["window", "sinks"]


@pytest.mark.parametrize("target", sorted(RUN))
def test_merging_two_parts_counts_the_sink_once(target):
    """Keys split in two (as over two devices), each part a whole call: merge_partials with the sink
    gives the attention over all keys, and its gradients."""
    spec = harness.spec_from_text(
        SINKS.format(axes="heads", expr="sinks[h]")
        .replace('[mask]\nexpr = "kv_idx <= q_idx - 2 and q_idx - kv_idx < window"\n', "")
        .replace('window = "int"\n', "")
    )
    q, k, v, sinks, cotangents = inputs(2, 4, 2, 37, 70, "heads", seed=11)
    if target == "triton":
        module = harness.load_target(spec, "triton_gpu")

        def merged(q, k, v, s):
            a = module.attention(q, k[:, :, :30], v[:, :, :30], sinks=s, return_lse=True)
            b = module.attention(q, k[:, :, 30:], v[:, :, 30:], sinks=s, return_lse=True)
            return module.merge_partials(*a, *b, s)

        out, lse, grads = torch_grads(merged, q, k, v, sinks, cotangents)
    else:
        import jax
        import jax.numpy as jnp

        module = harness.load_target(spec, "pallas_tpu")
        dout, dlse = (jnp.asarray(c.numpy()) for c in cotangents)

        def loss(q, k, v, s):
            a = module.attention(q, k[:, :, :30], v[:, :, :30], sinks=s, return_lse=True, interpret=True)
            b = module.attention(q, k[:, :, 30:], v[:, :, 30:], sinks=s, return_lse=True, interpret=True)
            out, lse = module.merge_partials(*a, *b, s)
            return (out * dout).sum() + (lse * dlse).sum(), (out, lse)

        args = [jnp.asarray(x.numpy()) for x in (q, k, v, sinks)]
        jax_grads, (out, lse) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*args)
        out, lse, *grads = (torch.from_numpy(np.asarray(x)) for x in (out, lse, *jax_grads))
    ref_out, ref_lse, ref_grads = torch_grads(
        lambda q, k, v, s: attention_ref_torch(spec, q, k, v, sinks=s), q, k, v, sinks, cotangents, torch.float64
    )
    assert_forward("float32", out, lse, ref_out, ref_lse)
    names = ("dq", "dk", "dv", "dsinks")
    assert_grads("float32", dict(zip(names, grads)), dict(zip(names, ref_grads)))


def test_compiled_sink_gradients_match_eager():
    """Under torch.compile the custom ops carry the sink's gradient too (their fake implementations
    included)."""
    spec = sinks_spec()
    module = harness.load_target(spec, "triton_gpu")
    q, k, v, sinks, cotangents = inputs(1, 2, 2, 24, 24, "heads", seed=13)
    eager = torch_grads(
        lambda *x: module.attention(*x[:3], window=9, sinks=x[3], return_lse=True), q, k, v, sinks, cotangents
    )
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda q, k, v, s: module.attention(q, k, v, window=9, sinks=s, return_lse=True), backend="aot_eager"
    )
    ours = torch_grads(compiled, q, k, v, sinks, cotangents)
    for a, b in zip(ours[2], eager[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_param_without_a_gradient_that_requires_one_is_refused():
    """A learnable param attngen gives no gradient (here: read by the sink through an expression)
    would silently stay as it is: refused, with the way out."""
    spec = sinks_spec(expr="0.5 * sinks[h] - 1.0")
    module = harness.load_target(spec, "triton_gpu")
    q, k, v, sinks, _ = inputs(1, 2, 2, 8, 8, "heads", seed=17)
    with pytest.raises(
        ValueError, match=r"param sinks requires grad, and attention gives it none: pass sinks.detach\(\)"
    ):
        module.attention(q, k, v, window=4, sinks=sinks.requires_grad_())
    module.attention(q, k, v, window=4, sinks=sinks.detach())
    with torch.no_grad():
        module.attention(q, k, v, window=4, sinks=sinks)
