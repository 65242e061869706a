"""The generated Triton module as a torch citizen: autograd, torch.compile, inference mode."""

import numpy as np
import pytest
import torch

from attngen.spec import load_spec
from tests import harness

SPEC = harness.with_dtype(load_spec("specs/sliding_window.toml"), "float32")


def _block(attention):
    """A pre-norm transformer block calling the generated op."""
    torch.manual_seed(0)
    heads, head_dim = 2, SPEC.head_dim
    norm, qkv, proj = (
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 3 * heads * head_dim),
        torch.nn.Linear(heads * head_dim, 64),
    )

    def block(x):
        batch, seq, _ = x.shape
        q, k, v = qkv(norm(x)).reshape(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        out = attention(q, k, v, window=16)
        return x + proj(out.transpose(1, 2).reshape(batch, seq, heads * head_dim))

    return block


def _module():
    return harness.load_target(SPEC, "triton_gpu")


def test_dynamo_sees_no_graph_break():
    block = _block(_module().attention)
    explanation = torch._dynamo.explain(block)(torch.randn(2, 40, 64))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compile_does_not_recompile_for_new_lengths():
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    block = torch.compile(_block(_module().attention), backend=counting_backend, dynamic=True)
    for seq in (33, 48, 71):
        x = torch.randn(2, seq, 64, requires_grad=True)
        block(x).sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
    assert len(graphs) == 1


def test_compiled_gradients_match_eager():
    attention = _module().attention
    torch._dynamo.reset()
    compiled = torch.compile(_block(attention), backend="aot_eager", dynamic=True)
    x = torch.randn(2, 37, 64, requires_grad=True)
    compiled(x).square().sum().backward()
    grad_compiled = x.grad.clone()
    x.grad = None
    _block(attention)(x).square().sum().backward()
    torch.testing.assert_close(grad_compiled, x.grad, rtol=1e-5, atol=1e-5)


def test_inference_mode_and_no_grad(monkeypatch):
    """Calls that want no gradient skip autograd's bookkeeping (host time): no autograd.Function."""
    module = _module()
    attention = module.attention
    monkeypatch.setattr(module._Attention, "apply", None)  # (calling it would raise)
    q, k, v = (torch.randn(1, 2, 20, SPEC.head_dim) for _ in range(3))
    with torch.inference_mode():
        out = attention(q, k, v, window=5)
    assert not out.requires_grad
    with torch.no_grad():
        torch.testing.assert_close(attention(q, k, v, window=5), out)


def test_requires_grad_on_some_inputs_only():
    attention = _module().attention
    q = torch.randn(1, 2, 20, SPEC.head_dim, requires_grad=True)
    k, v = (torch.randn(1, 2, 20, SPEC.head_dim) for _ in range(2))
    attention(q, k, v, window=5).sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("used", ["out", "lse"])
def test_gradients_through_out_or_lse_alone_are_exact(used, monkeypatch):
    """Eager autograd hands the backward None for the output left unused, not zeros made on the GPU:
    the gradients through out alone, or lse alone, against float64 with the other cotangent zero,
    and the backward given None for lse's gradient where lse went unused."""
    module = _module()
    p = harness.make_problem(SPEC, 1, 2, 37, 45, seed=3, params={"window": 9})
    c = harness.make_cotangents(p, seed=3)
    if used == "out":
        c = harness.Cotangents(c.dout, np.zeros_like(c.dlse))
    else:
        c = harness.Cotangents(np.zeros_like(c.dout), c.dlse)
    given = []
    backward = module._backward

    def recorded(dout, dlse, *rest):
        given.append(dlse)
        return backward(dout, dlse, *rest)

    monkeypatch.setattr(module, "_backward", recorded)
    q, k, v = (torch.from_numpy(x).requires_grad_() for x in (p.q, p.k, p.v))
    out, lse = module.attention(q, k, v, scale=p.scale, return_lse=True, window=9)
    output, cotangent = (out, c.dout) if used == "out" else (lse, c.dlse)
    grads = torch.autograd.grad(output, [q, k, v], torch.from_numpy(cotangent))
    harness.assert_grads_exact(SPEC, p, c, [g.numpy() for g in grads])
    assert (given[0] is None) == (used == "out")


def test_compiled_calls_the_custom_op_and_eager_the_function():
    """One pair of kernels, two entry points: torch.compile traces the custom op (fake tensors, no graph
    break); eager calls go through a torch.autograd.Function, which costs less host time per call."""
    module = _module()
    graphs = []

    def capturing_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 20, SPEC.head_dim, requires_grad=True) for _ in range(3))
    torch.compile(lambda q, k, v: module.attention(q, k, v, window=5), backend=capturing_backend)(q, k, v)
    called = {str(node.target) for g in graphs for node in g.graph.nodes if node.op == "call_function"}
    assert any(f"attngen.{module._OP}_fwd" in target for target in called), called
    assert type(module.attention(q, k, v, window=5).grad_fn).__name__ == "_AttentionBackward"
