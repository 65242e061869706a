"""The generated Triton module as a torch citizen: autograd, torch.compile, inference mode."""

from pathlib import Path

import numpy as np
import pytest
import torch

import attngen
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


# ----------------------------------------------------------------------------- every entry point under torch.compile


def _compiled(fn):
    """fn under torch.compile(fullgraph=True): a graph break raises. aot_eager runs the traced graph,
    whose ops (attngen's among them) run the eager kernels: results equal eager calls bit for bit."""
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _torch_params(name, batch, heads, length):
    params = harness.example_params(name, batch, heads, length, length)
    return {key: torch.as_tensor(value) if isinstance(value, np.ndarray) else value for key, value in params.items()}


@pytest.mark.parametrize("spec_file", sorted(Path("specs").glob("*.toml")), ids=lambda path: path.stem)
def test_every_spec_runs_whole_under_torch_compile(spec_file):
    """attention (forward, backward, a trained param's gradient) and attention_with_kvcache of every
    spec traced whole, each spec's params in its op's signature: specs with tensor params used to
    fail at tracing (their fake forward took other arguments than the op)."""
    module = harness.load_target(load_spec(spec_file), "triton_gpu")
    batch, heads, length = 1, 2, 24
    params = _torch_params(spec_file.stem, batch, heads, length)
    trained = [params[name].float().requires_grad_() for name in getattr(module, "TRAINED_PARAMS", ())]
    params |= dict(zip(getattr(module, "TRAINED_PARAMS", ()), trained))
    torch.manual_seed(0)
    shapes = [(batch, heads, length, module.HEAD_DIM)] * 2 + [(batch, heads, length, module.HEAD_DIM_V)]
    q, k, v = (torch.randn(shape, dtype=module.DTYPE, requires_grad=True) for shape in shapes)

    def forward(q, k, v):
        return module.attention(q, k, v, **params)

    results = []
    for run in (_compiled(forward), forward):
        out = run(q, k, v)
        results.append((out, *torch.autograd.grad(out.float().square().sum(), (q, k, v, *trained))))
    for compiled, eager in zip(*results):
        assert torch.equal(compiled, eager)

    def decode(q, k_cache, v_cache, lengths):
        return module.attention_with_kvcache(q, k_cache, v_cache, lengths, **params)

    lengths = torch.tensor([length - 3], dtype=torch.int32)
    cache = (q.detach()[:, :, -1:], k.detach(), v.detach(), lengths)
    assert torch.equal(_compiled(decode)(*cache), decode(*cache))


def test_the_cache_entry_point_under_torch_compile_appends_pages_and_packs_as_eager():
    """attention_with_kvcache traced whole, with what serving passes: pages, an append (an op that
    writes the caches in place, also under inductor), packed new tokens (cu_seqlens_q), an FP8
    cache with its factors as numbers, and one length for every sequence that changes each step
    (symbolic under dynamic shapes: one graph)."""
    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    torch.manual_seed(1)
    heads, kv_heads, dim, page, pages = 8, 2, module.HEAD_DIM, 16, 12
    k_cache, v_cache = (torch.randn(pages, kv_heads, page, dim, dtype=module.DTYPE) for _ in range(2))
    block_table = torch.randperm(pages, dtype=torch.int32)[:12].reshape(3, 4)
    lengths = torch.tensor([20, 33, 50], dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    q = torch.randn(6, heads, dim, dtype=module.DTYPE)
    k, v = (torch.randn(6, kv_heads, dim, dtype=module.DTYPE) for _ in range(2))

    def step(q, k_cache, v_cache, k, v):
        return module.attention_with_kvcache(
            q, k_cache, v_cache, lengths, k=k, v=v, block_table=block_table, cu_seqlens_q=cu_seqlens_q, return_lse=True
        )

    for backend in ("aot_eager", "inductor"):
        caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend=backend)(q, *caches[0], k, v)
        eager = step(q, *caches[1], k, v)
        for a, b in zip((*compiled, *caches[0]), (*eager, *caches[1])):
            assert torch.equal(a, b), backend
        assert not torch.equal(caches[0][0], k_cache)  # (the append wrote)

    graphs = []

    def counting(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    fp8_k, fp8_v = (torch.randn(2, kv_heads, 64, dim).to(torch.float8_e4m3fn) for _ in range(2))
    one_token = torch.randn(2, heads, 1, dim, dtype=module.DTYPE)

    def decode(q, length):
        return module.attention_with_kvcache(q, fp8_k, fp8_v, length, k_descale=0.5, v_descale=2.0)

    torch._dynamo.reset()
    compiled = torch.compile(decode, fullgraph=True, backend=counting, dynamic=True)
    for length in (10, 37, 64):
        assert torch.equal(compiled(one_token, length), decode(one_token, length))
    assert len(graphs) == 1


def test_the_forward_backward_and_packed_entry_points_under_torch_compile():
    """attention_forward and attention_backward (ring attention's) and the packed module's
    attention_varlen (its offsets checked inside an op) traced whole, equal to eager calls."""
    spec = load_spec("specs/causal.toml")
    module = harness.load_target(spec, "triton_gpu")
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, module.HEAD_DIM, dtype=module.DTYPE) for _ in range(3))
    out, lse = module.attention_forward(q, k, v)

    def both(q, k, v, dout):
        out, lse = module.attention_forward(q, k, v)
        return out, lse, *module.attention_backward(dout, None, q, k, v, out, lse)

    for a, b in zip(_compiled(both)(q, k, v, out), both(q, k, v, out)):
        assert torch.equal(a, b)

    varlen = attngen.load(spec, "triton_gpu", varlen=True, cache_dir=harness.build_dir())
    cu_seqlens = torch.tensor([0, 10, 10, 31], dtype=torch.int32)
    packed = [torch.randn(31, 2, module.HEAD_DIM, dtype=module.DTYPE, requires_grad=True) for _ in range(3)]

    def packed_call(q, k, v, cu_seqlens):
        return varlen.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, return_lse=True)

    results = []
    for run in (_compiled(packed_call), packed_call):
        out, lse = run(*packed, cu_seqlens)
        results.append((out, lse, *torch.autograd.grad(out.float().square().sum(), packed)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        _compiled(packed_call)(*packed, torch.tensor([0, 12, 10, 31], dtype=torch.int32))


def test_the_fp8_forward_traces_into_its_op(monkeypatch):
    """attention_fp8 runs on Hopper only, so here it is traced, not run: one graph around its op,
    outputs in the spec's dtype."""
    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    monkeypatch.setattr(module, "_runs_sm90", lambda q, enabled: True)
    graphs = []

    class Traced(Exception):
        pass

    def capturing(graph_module, example_inputs):  # (the graph is kept, and not run)
        graphs.append(graph_module)

        def run(*args):
            raise Traced

        return run

    q, k, v = (torch.randn(1, 2, 64, module.HEAD_DIM).to(torch.float8_e4m3fn) for _ in range(3))

    def forward(q, k, v):
        return module.attention_fp8(q, k, v, q_descale=0.5)

    torch._dynamo.reset()
    compiled = torch.compile(forward, fullgraph=True, backend=capturing)
    with pytest.raises(Traced):
        compiled(q, k, v)
    (graph,) = graphs
    calls = [node for node in graph.graph.nodes if f"{module._OP}_fp8" in str(node.target)]
    assert len(calls) == 1
    assert calls[0].meta["example_value"][0].dtype == module.DTYPE
