"""FlashAttention's variable-length interface: `attention_varlen` of a spec's packed form
(attngen.spec.packed, `attngen.load(..., varlen=True)`), on both targets, against the float64
reference of the spec over each sequence alone -- masks and scores that read positions, lengths,
the batch index and params, sequences of unequal and zero length, gradients; bad cu_seqlens."""

import numpy as np
import pytest
import torch

from attngen.errors import SpecError
from attngen.exactness import assert_forward, assert_grads
from attngen.reference import attention_ref_torch
from attngen.spec import load_spec, packed, retarget, with_config
from tests import harness

LENGTHS_Q = [5, 0, 37, 20]
LENGTHS_K = [9, 3, 37, 41]  # bottom-right alignment makes q_len != kv_len matter
HEADS, KV_HEADS, DIM = 4, 2, 32


def small(name):
    spec = retarget(load_spec(f"specs/{name}.toml"), DIM, "float32")
    spec = with_config(spec, "triton_gpu", block_m=16, block_n=16, dq_block_m=16, dq_block_n=16,
                       dkdv_block_m=16, dkdv_block_n=16, short_block_m=16, short_block_n=16)  # fmt: skip
    return with_config(spec, "pallas_tpu", block_q=16, block_kv=128)


def per_sequence_params(name, seqs):
    """(the packed call's params, each sequence's own)."""
    g = torch.Generator().manual_seed(1)
    if name == "sliding_window":
        return {"window": 7}, [{"window": 7}] * seqs
    if name == "softcap":
        return {"softcap": 20.0}, [{"softcap": 20.0}] * seqs
    if name == "alibi_slopes":
        slopes = torch.rand(HEADS, generator=g) * 0.5
        return {"slopes": slopes}, [{"slopes": slopes}] * seqs
    if name == "prefix_lm_batched":  # one prefix per sequence: b is the sequence
        prefix = torch.randint(-2, 30, (seqs,), generator=g, dtype=torch.int32)
        return {"prefix": prefix}, [{"prefix": prefix[s : s + 1]} for s in range(seqs)]
    if name == "sinks":
        sinks = 2 * torch.randn(HEADS, generator=g)
        return {"sinks": sinks}, [{"sinks": sinks}] * seqs
    return {}, [{}] * seqs


def packed_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(LENGTHS_Q), HEADS, DIM, generator=g)
    k, v = (torch.randn(sum(LENGTHS_K), KV_HEADS, DIM, generator=g) for _ in range(2))
    cu = [torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32) for lengths in (LENGTHS_Q, LENGTHS_K)]
    return q, k, v, *cu


def reference(spec, q, k, v, cu_q, cu_k, params_of, dtype=torch.float64):
    """out [total_q, heads, D] and lse [heads, total_q]: the spec over each sequence alone."""
    outs, lses = [], []
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        one = [x[None].transpose(1, 2).to(dtype) for x in (q[rows], k[keys], v[keys])]
        out, lse = attention_ref_torch(spec, *one, **params_of[s])
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
@pytest.mark.parametrize(
    "name", ["causal", "causal_bottom_right", "sliding_window", "alibi_slopes", "prefix_lm_batched", "softcap", "sinks"]
)
def test_each_sequence_is_attended_on_its_own(target, name):
    spec = small(name)
    module = harness.load_target(packed(spec), target)
    q, k, v, cu_q, cu_k = packed_inputs(seed=len(name))
    params, params_of = per_sequence_params(name, len(LENGTHS_Q))
    if target == "triton_gpu":
        out, lse = module.attention_varlen(
            q, k, v, cu_q, cu_k, max(LENGTHS_Q), max(LENGTHS_K), return_lse=True, **params
        )
    else:
        import jax.numpy as jnp

        args = [jnp.asarray(x.numpy()) for x in (q, k, v, cu_q, cu_k)]
        jax_params = {n: jnp.asarray(p.numpy()) if isinstance(p, torch.Tensor) else p for n, p in params.items()}
        out, lse = module.attention_varlen(*args, return_lse=True, interpret=True, **jax_params)
        out, lse = (torch.from_numpy(np.asarray(x)) for x in (out, lse))
    ref_out, ref_lse = reference(spec, q, k, v, cu_q, cu_k, params_of)
    assert out.shape == q.shape and lse.shape == (HEADS, q.shape[0])
    assert_forward("float32", out.transpose(0, 1), lse, ref_out.transpose(0, 1), ref_lse)  # rows as the LSE's


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
@pytest.mark.parametrize("lengths_k", [[9, 3], [0, 0]])
def test_a_batch_with_no_query_at_all(target, lengths_k):
    """Every sequence without a query (total_q = 0; keys or none): an empty output, as FlashAttention
    gives (the packing's [1, 0] tensors were refused as empty params)."""
    spec = small("sliding_window")
    module = harness.load_target(packed(spec), target)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(0, HEADS, DIM)
    k, v = (torch.randn(sum(lengths_k), KV_HEADS, DIM, generator=g) for _ in range(2))
    cu_q, cu_k = (torch.tensor(np.cumsum([0, *lengths]), dtype=torch.int32) for lengths in ([0, 0], lengths_k))
    if target == "triton_gpu":
        out, lse = module.attention_varlen(q, k, v, cu_q, cu_k, 0, max(lengths_k), return_lse=True, window=7)
    else:
        import jax.numpy as jnp

        args = [jnp.asarray(x.numpy()) for x in (q, k, v, cu_q, cu_k)]
        out, lse = module.attention_varlen(*args, return_lse=True, interpret=True, window=7)
    assert tuple(out.shape) == (0, HEADS, DIM) and tuple(lse.shape) == (HEADS, 0)


def test_gradients_flow_through_the_packed_tensors():
    spec = small("causal_bottom_right")
    module = harness.load_target(packed(spec), "triton_gpu")
    q, k, v, cu_q, cu_k = packed_inputs(seed=3)
    dout = torch.randn_like(q, generator=torch.Generator().manual_seed(4))

    def grads(fn, dtype):
        leaves = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad((fn(*leaves) * dout.to(dtype)).sum(), leaves)

    ours = grads(lambda *x: module.attention_varlen(*x, cu_q, cu_k), torch.float32)
    ref = grads(lambda *x: reference(spec, *x, cu_q, cu_k, [{}] * len(LENGTHS_Q))[0], torch.float64)
    assert_grads("float32", ours, ref)


def test_bad_cu_seqlens_are_refused():
    module = harness.load_target(packed(small("causal")), "triton_gpu")
    q, k, v, cu_q, cu_k = packed_inputs(seed=5)
    with pytest.raises(ValueError, match="end at 62, the packed length"):
        module.attention_varlen(q, k, v, cu_q[:-1], cu_k[:-1])
    with pytest.raises(ValueError, match="count different sequences"):
        module.attention_varlen(q, k, v, cu_q, cu_k[:-1])
    with pytest.raises(TypeError, match="1-D int32"):
        module.attention_varlen(q, k, v, cu_q.long(), cu_k)


def test_specs_without_a_packed_form_say_why():
    with pytest.raises(SpecError, match="tensor params along q_len or kv_len \\(bias\\)"):
        packed(load_spec("specs/bias.toml"))
    with pytest.raises(SpecError, match="take the names of the packing tensors"):
        packed(load_spec("specs/varlen.toml"))
