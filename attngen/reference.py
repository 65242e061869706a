"""The oracle: exact attention in float64, evaluated from the same IR as the kernels.

Goals: the contract the generated modules document -- mask true = attend; a row with no visible key gives output 0
and LSE -inf; LSE in natural log; `score` is scale * q.k before the score expression. numpy for
the forward (attention_ref); torch float64 with autograd for gradients (attention_ref_torch),
which differentiates the score expression independently of the kernels' sympy derivative.
Non-goals: speed (it materialises the [batch, heads, q_len, kv_len] scores).
"""

from __future__ import annotations

import numpy as np

from attngen import ir
from attngen.ir import Type
from attngen.spec import Spec

_OPS = {
    "+": "add",
    "-": "subtract",
    "*": "multiply",
    "/": "true_divide",
    "//": "floor_divide",
    "%": "remainder",  # floor modulo in numpy and torch alike
    "==": "equal",  # torch.equal compares whole tensors: torch spells it "eq" (see _name)
    "!=": "not_equal",
    "<": "less",
    "<=": "less_equal",
    ">": "greater",
    ">=": "greater_equal",
    "and": "logical_and",
    "or": "logical_or",
    "exp": "exp",
    "log": "log",
    "sqrt": "sqrt",
    "tanh": "tanh",
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "exp2": "exp2",
    "log2": "log2",
    "abs": "abs",
    "min": "minimum",
    "max": "maximum",
}


def _name(xp, op: str) -> str:
    name = _OPS[op]
    return "eq" if _is_torch(xp) and name == "equal" else name


def _is_torch(xp) -> bool:
    return xp.__name__ == "torch"


def _widths(xp):
    """(int dtype, float dtype) of evaluate's results: 64-bit in numpy and torch, jax.numpy's own
    defaults in JAX (32-bit unless x64 is on)."""
    if xp is np or _is_torch(xp):
        return xp.int64, xp.float64
    return xp.asarray(0).dtype, xp.asarray(0.0).dtype


def evaluate(e: ir.Expr, env: dict, xp=np):
    """Value of e with broadcasting in array module xp (numpy, torch, or jax.numpy: context
    parallelism's sinks): ints int64, floats float64 (jax.numpy: its default widths), // and %
    floor. Variables in env may be arrays or Python numbers."""
    is_torch = _is_torch(xp)
    ints, floats = _widths(xp)
    if isinstance(e, ir.Const):
        dtype = {Type.BOOL: xp.bool if is_torch else xp.bool_, Type.INT: ints, Type.FLOAT: floats}[e.type]
        return xp.asarray(e.value, dtype=dtype)
    if isinstance(e, ir.Var):
        value = env[e.name]
        dtype = floats if e.type is Type.FLOAT else ints
        return value.to(dtype) if is_torch and isinstance(value, xp.Tensor) else xp.asarray(value, dtype=dtype)
    ev = lambda x: evaluate(x, env, xp)
    if isinstance(e, ir.ToFloat):
        value = ev(e.operand)
        return value.to(floats) if is_torch else value.astype(floats)
    if isinstance(e, ir.Neg):
        return -ev(e.operand)
    if isinstance(e, ir.Not):
        return xp.logical_not(ev(e.operand))
    with np.errstate(all="ignore"):
        if isinstance(e, (ir.Arith, ir.Compare, ir.Logic)):
            return getattr(xp, _name(xp, e.op))(ev(e.lhs), ev(e.rhs))
        if isinstance(e, ir.Where):
            return xp.where(ev(e.cond), ev(e.if_true), ev(e.if_false))
        if isinstance(e, ir.Func):
            return getattr(xp, _name(xp, e.name))(*(ev(a) for a in e.args))
        if isinstance(e, ir.Load):
            return _load(e, env, xp)
    raise AssertionError(f"unhandled IR node {e!r}")


def _load(e: ir.Load, env: dict, xp):
    """tensor[indices] with broadcasting, each index clamped into its axis (the kernels' rule)."""
    is_torch = _is_torch(xp)
    tensor = env[e.tensor]
    tensor = xp.as_tensor(tensor) if is_torch else xp.asarray(tensor)
    indices = [evaluate(index, env, xp) for index in e.indices]
    if is_torch:  # torch indexing does not broadcast its index tensors
        indices = xp.broadcast_tensors(*(i.to(tensor.device) for i in indices))
    value = tensor[tuple(xp.clip(i, 0, n - 1) for i, n in zip(indices, tensor.shape))]
    if e.type is Type.BOOL:
        return value != 0
    ints, floats = _widths(xp)
    dtype = floats if e.type is Type.FLOAT else ints
    return value.to(dtype) if is_torch else value.astype(dtype)


def positions(batch: int, heads: int, q_len: int, kv_len: int, xp=np, **device) -> dict:
    """b, h, q_idx, kv_idx as arrays of xp (numpy or torch) broadcasting to [B, H, Lq, Lk], and
    the lengths q_len, kv_len."""
    arange = (lambda n: xp.arange(n, **device)) if device else xp.arange
    return {
        "b": arange(batch).reshape(-1, 1, 1, 1),
        "h": arange(heads).reshape(1, -1, 1, 1),
        "q_idx": arange(q_len).reshape(1, 1, -1, 1),
        "kv_idx": arange(kv_len).reshape(1, 1, 1, -1),
        "q_len": q_len,
        "kv_len": kv_len,
    }


def dense_mask(spec: Spec, batch: int, heads: int, q_len: int, kv_len: int, params: dict) -> np.ndarray:
    """[batch, heads, q_len, kv_len] bool: True where a query attends to a key."""
    shape = (batch, heads, q_len, kv_len)
    if spec.mask is None:
        return np.ones(shape, dtype=bool)
    return np.broadcast_to(evaluate(spec.mask, {**positions(batch, heads, q_len, kv_len), **params}), shape)


def kv_heads_expanded(x, heads: int, xp=np):
    """k or v [B, H_kv, L, D] with each kv head repeated for its H / H_kv query heads (GQA/MQA)."""
    group, rest = divmod(heads, x.shape[1])
    if rest:
        raise ValueError(f"{heads} query heads cannot share {x.shape[1]} kv heads evenly")
    return np.repeat(x, group, axis=1) if xp is np else x.repeat_interleave(group, dim=1)


def attention_ref(spec: Spec, q, k, v, *, scale: float | None = None, **params) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) in float64 for q [B, H, Lq, D], k, v [B, H_kv, Lk, D] (any array-likes;
    H_kv divides H: query head h reads kv head h // (H / H_kv))."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, heads, q_len, head_dim = q.shape
    k, v = (kv_heads_expanded(x, heads) for x in (k, v))
    kv_len = k.shape[2]
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    score = scale * np.matmul(q, k.swapaxes(-1, -2))
    if spec.score is not None:
        env = {"score": score, **positions(batch, heads, q_len, kv_len), **params}
        score = np.broadcast_to(evaluate(spec.score, env), score.shape)
    visible = dense_mask(spec, batch, heads, q_len, kv_len, params)
    score = np.where(visible, score, -np.inf)
    row_max = score.max(axis=-1, keepdims=True, initial=-np.inf)
    sink = None
    if spec.sink is not None:  # one more logit in every row's denominator, with no value
        sink = np.broadcast_to(evaluate(spec.sink, {**positions(batch, heads, 1, 1), **params}), (batch, heads, 1, 1))
        row_max = np.maximum(row_max, sink)
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(score - shift)
    total = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - shift)
    out = np.matmul(p / np.where(total == 0, 1.0, total), v)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] == 0, -np.inf, np.log(total[..., 0]) + shift[..., 0])
    return out, lse


def attention_ref_torch(spec: Spec, q, k, v, *, scale: float | None = None, dtype=None, fp8_probs=False, **params):
    """(out, lse) in torch, differentiable by autograd; q, k, v are torch tensors on any device.

    dtype (default float64) is the precision of every step but the score expression, which is
    evaluated in float64 and rounded back: a lower dtype makes this the plain framework
    implementation that the FlashAttention test rule compares kernels with. fp8_probs: P = exp(score
    - max) rounded to e4m3 for P V and summed unrounded, as an FP8 forward computes it (with dtype
    float32, the FP8 baseline of attngen.exactness).
    """
    import torch

    dtype = dtype or torch.float64
    q, k, v = (x.to(dtype) for x in (q, k, v))
    batch, heads, q_len, head_dim = q.shape
    k, v = (kv_heads_expanded(x, heads, torch) for x in (k, v))  # autograd sums each group's gradients
    kv_len = k.shape[2]
    if scale is None:
        scale = 1.0 / float(np.sqrt(head_dim))
    device = q.device
    index = positions(batch, heads, q_len, kv_len, torch, device=device)
    score = scale * (q @ k.transpose(-1, -2))
    if spec.score is not None:
        score = evaluate(spec.score, {"score": score, **index, **params}, torch).to(dtype).expand_as(score)
    visible = torch.ones((), dtype=torch.bool, device=device)
    if spec.mask is not None:
        visible = evaluate(spec.mask, {**index, **params}, torch).to(device)
    visible = visible.expand(batch, heads, q_len, kv_len)
    # Masked entries leave the graph through where(): their gradient is exactly 0.
    score = torch.where(visible, score, torch.zeros((), dtype=dtype, device=device))
    shift = torch.where(visible, score, torch.full((), -torch.inf, dtype=dtype, device=device))
    row_max = (
        shift.amax(dim=-1, keepdim=True)
        if kv_len
        else torch.full((batch, heads, q_len, 1), -torch.inf, dtype=dtype, device=device)
    )
    sink = None
    if spec.sink is not None:  # one more logit in every row's denominator, with no value
        index = positions(batch, heads, 1, 1, torch, device=device)
        sink = evaluate(spec.sink, {**index, **params}, torch).to(dtype).expand(batch, heads, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, 0.0).detach()
    p = torch.where(visible, torch.exp(score - row_max), 0.0)
    total = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - row_max)
    if fp8_probs:
        out = (p.to(torch.float8_e4m3fn).to(dtype) @ v) / torch.where(total == 0, 1.0, total)
    else:
        out = (p / torch.where(total == 0, 1.0, total)) @ v
    lse = torch.where(
        total[..., 0] == 0, -torch.inf, torch.log(torch.where(total == 0, 1.0, total))[..., 0] + row_max[..., 0]
    )
    return out, lse
