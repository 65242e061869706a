"""Gradients into float tensor params ([grad] params) on both targets, against float64 autograd.

A trained read is at indices that read no position (slopes[h], temperature[b, h]: each program
sums its pairs), at the pair's own b, h, q_idx, kv_idx (a full additive bias: each pair its
element), or with one index of q_idx - kv_idx (a relative table: the pairs of a diagonal share an
element, each program sums its tiles' diagonals). The spec below has all three kinds (the relative
one bucketed by a floor division of negative distances, and clamped into its table), a derivative
that reads the score (a per-head soft cap), GQA, a causal mask with whole tiles hidden, odd lengths
with q_len != kv_len, and a tensor param that is not trained.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attngen.errors import AttngenError, SpecError
from attngen.exactness import assert_forward, assert_grads
from attngen.reference import attention_ref_torch
from attngen.spec import parse_spec, with_config
from tests import harness

TRAINED = """
name = "trained"
head_dim = 32
dtype = "float32"

[mask]
causal = "bottom_right"

[score]
expr = "cap[h] * tanh(score / cap[h]) + slopes[h] * (kv_idx - q_idx) + bias[b, h, q_idx, kv_idx] + shift[h] + rel[h, (q_idx - kv_idx) // 3 + 12]"

[params]
cap = "float[heads]"
slopes = "float[heads]"
bias = "float[batch, heads, q_len, kv_len]"
shift = "float[heads]"
rel = "float[heads, buckets]"

[grad]
params = ["cap", "slopes", "bias", "rel"]
"""
BATCH, HEADS, KV_HEADS, Q_LEN, KV_LEN, DIM = 2, 4, 2, 37, 45, 32
TRAINED_NAMES = ("cap", "slopes", "bias", "rel")


def small(text):
    spec = parse_spec(text, "trained.toml")
    spec = with_config(spec, "triton_gpu", block_m=16, block_n=16, dq_block_m=16, dq_block_n=16,
                       dkdv_block_m=16, dkdv_block_n=16, short_block_m=16, short_block_n=16)  # fmt: skip
    return with_config(spec, "pallas_tpu", block_q=16, block_kv=128)


def problem(relative_entries):
    g = torch.Generator().manual_seed(5)
    q, do = (torch.randn(BATCH, HEADS, Q_LEN, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(BATCH, KV_HEADS, KV_LEN, DIM, generator=g) for _ in range(2))
    params = {
        "cap": 2 + 3 * torch.rand(HEADS, generator=g),
        "slopes": 0.1 * torch.rand(HEADS, generator=g),
        "bias": torch.randn(BATCH, HEADS, Q_LEN, KV_LEN, generator=g),
        "shift": torch.randn(HEADS, generator=g),
        "rel": torch.randn(HEADS, relative_entries, generator=g),
    }
    return q, k, v, do, params


# Relative reads, with their tables' lengths (distances run -44..36): bucketed (the spec's; the first
# buckets clamp to 0), one entry per distance (a tile's diagonals read entries of more than one of
# the dQ kernel's chunks of 32), and one whose entries wrap around (`%`).
RELATIVE = {
    "bucketed": ("(q_idx - kv_idx) // 3 + 12", 25),
    "per distance": ("q_idx - kv_idx + 40", 81),
    "wrapped": ("(q_idx - kv_idx) % 37 + 3", 41),
}


@pytest.mark.parametrize("relative", RELATIVE)
@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_trained_params_get_exact_gradients(target, relative):
    index, entries = RELATIVE[relative]
    spec = small(TRAINED.replace("(q_idx - kv_idx) // 3 + 12", index))
    q, k, v, do, params = problem(entries)
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    trained = {n: t.double().requires_grad_() if n in TRAINED_NAMES else t.double() for n, t in params.items()}
    ref_out, ref_lse = attention_ref_torch(spec, *leaves, **trained)
    (ref_out * do.double()).sum().backward()
    names = ["dq", "dk", "dv", *(f"d{n}" for n in TRAINED_NAMES)]
    ref_grads = dict(zip(names, [x.grad for x in leaves] + [trained[n].grad for n in TRAINED_NAMES]))
    module = harness.load_target(spec, target)
    if target == "triton_gpu":
        ours = {n: t.clone().requires_grad_(n in TRAINED_NAMES) for n, t in params.items()}
        qkv = [x.clone().requires_grad_() for x in (q, k, v)]
        out, lse = module.attention(*qkv, return_lse=True, **ours)
        (out * do).sum().backward()
        grads = [x.grad for x in qkv] + [ours[n].grad for n in TRAINED_NAMES]
        out, lse = out.detach(), lse.detach()
    else:
        import jax

        arrays = {n: t.numpy() for n, t in params.items()}

        def loss(q, k, v, cap, slopes, bias, rel):
            out, lse = module.attention(
                q,
                k,
                v,
                return_lse=True,
                interpret=True,
                cap=cap,
                slopes=slopes,
                bias=bias,
                rel=rel,
                shift=arrays["shift"],
            )
            return (out * do.numpy()).sum(), (out, lse)

        (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=tuple(range(7)), has_aux=True)(
            *(x.numpy() for x in (q, k, v)), *(arrays[n] for n in TRAINED_NAMES)
        )
    assert_forward("float32", np.asarray(out), np.asarray(lse), ref_out.detach().numpy(), ref_lse.detach().numpy())
    assert_grads("float32", dict(zip(names, (np.asarray(g) for g in grads))), ref_grads)


@pytest.mark.parametrize("call", ["eager", "custom op"])
def test_params_passed_without_requires_grad_are_not_trained(call, monkeypatch):
    """A [grad] param given without requires_grad (ALiBi slopes held fixed) costs nothing: the
    backward skips every trained read's gradient (no buffers, the dQ kernel's TRAIN = 0), and q, k,
    v's gradients are those of the training call, bit for bit."""
    spec = small(TRAINED)
    q, k, v, do, params = problem(RELATIVE["bucketed"][1])
    module = harness.load_target(spec, "triton_gpu")
    attention = module.attention
    if call == "custom op":  # what torch.compile traces; eager calls take an autograd.Function
        torch._dynamo.reset()
        attention = torch.compile(module.attention, backend="aot_eager")
    trains = []
    buffers = module._grad_buffers
    monkeypatch.setattr(module, "_grad_buffers", lambda *args: trains.append(args[-1]) or buffers(*args))

    def grads(requires_grad):
        ours = {n: t.clone().requires_grad_(requires_grad and n in TRAINED_NAMES) for n, t in params.items()}
        qkv = [x.clone().requires_grad_() for x in (q, k, v)]
        (attention(*qkv, **ours) * do).sum().backward()
        return [x.grad for x in qkv], [ours[n].grad for n in TRAINED_NAMES]

    (trained_qkv, trained_params), (fixed_qkv, fixed_params) = grads(True), grads(False)
    assert trains == [True, False]
    assert all(g is not None for g in trained_params) and all(g is None for g in fixed_params)
    assert all(torch.equal(a, b) for a, b in zip(trained_qkv, fixed_qkv))


def test_a_trained_read_of_another_kind_is_refused_at_build():
    """A read whose indices read the positions otherwise than as the pair's own or through one
    index of q_idx - kv_idx alone has no deterministic gradient here: the build says so; so does a
    positional read of a tensor declared with other axes."""
    for other in ("bias[b, h, q_idx, q_idx - kv_idx]", "bias[b, h, q_idx + kv_idx, 0]", "bias[b, h, 0, q_idx]"):
        with pytest.raises(AttngenError, match="at the pair's own"):
            harness.load_target(small(TRAINED.replace("bias[b, h, q_idx, kv_idx]", other)), "triton_gpu")
    loose = TRAINED.replace('bias = "float[batch, heads, q_len, kv_len]"', 'bias = "float[batch, heads, n, m]"')
    with pytest.raises(AttngenError, match=r"must be declared float\[batch, heads, q_len, kv_len\]"):
        harness.load_target(small(loose), "pallas_tpu")


@pytest.mark.parametrize(
    "change, message",
    [
        ('params = ["cap", "nope"]', "'nope' is not a declared param"),
        ('params = ["cap", "cap"]', "names a param twice"),
        ('params = ["shift", "count"]', "`count` is int\\[heads\\]: only float tensors get gradients"),
        ('params = ["scalar"]', "`scalar` is float: only float tensors get gradients"),
        ('params = ["unread"]', "`unread` is not read in the \\[score\\] expr"),
    ],
)
def test_grad_declarations_are_checked(change, message):
    text = TRAINED.replace('params = ["cap", "slopes", "bias", "rel"]', change)
    text = text.replace(
        'shift = "float[heads]"',
        'shift = "float[heads]"\ncount = "int[heads]"\nscalar = "float"\nunread = "float[heads]"',
    )
    text = text.replace("+ shift[h]", "+ shift[h] + count[h] * scalar + where(unread[h] > 0.0, 0.0, 0.0) * 0.0")
    if "unread" in change:  # read only by the mask
        text = text.replace("+ where(unread[h] > 0.0, 0.0, 0.0) * 0.0", "").replace(
            'causal = "bottom_right"', 'expr = "q_idx + kv_len - q_len >= kv_idx and unread[h] > -1.0"'
        )
    with pytest.raises(SpecError, match=message):
        parse_spec(text, "trained.toml")


def test_the_sinks_param_is_not_declared_again():
    sinks = Path("specs/sinks.toml").read_text() + '\n[grad]\nparams = ["sinks"]\n'
    with pytest.raises(SpecError, match="gets its gradient through the sink already"):
        parse_spec(sinks, "sinks.toml")
