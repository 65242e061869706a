"""The oracle: exact attention in float64 numpy, evaluated from the same IR as the kernels.

Goals: the contract of DESIGN.md -- mask true = attend; a row with no visible key gives output 0
and LSE -inf; LSE in natural log; `score` is scale * q.k before the score expression.
Non-goals: speed (it materialises the [batch, heads, q_len, kv_len] scores).
"""

from __future__ import annotations

import numpy as np

from attngen import ir
from attngen.ir import Type
from attngen.spec import Spec

_NUMPY_FUNCTIONS = {
    "exp": np.exp,
    "log": np.log,
    "sqrt": np.sqrt,
    "tanh": np.tanh,
    "abs": np.abs,
    "min": np.minimum,
    "max": np.maximum,
}


def evaluate(e: ir.Expr, env: dict[str, np.ndarray | int | float]) -> np.ndarray:
    """Value of e with numpy broadcasting; ints are int64, floats float64, // and % floor."""
    if isinstance(e, ir.Const):
        dtype = {Type.BOOL: np.bool_, Type.INT: np.int64, Type.FLOAT: np.float64}[e.type]
        return np.asarray(e.value, dtype=dtype)
    if isinstance(e, ir.Var):
        value = np.asarray(env[e.name])
        return value.astype(np.float64 if e.type is Type.FLOAT else np.int64)
    ev = lambda x: evaluate(x, env)  # noqa: E731
    if isinstance(e, ir.ToFloat):
        return ev(e.operand).astype(np.float64)
    if isinstance(e, ir.Neg):
        return -ev(e.operand)
    if isinstance(e, ir.Not):
        return ~ev(e.operand)
    if isinstance(e, (ir.Arith, ir.Compare, ir.Logic)):
        a, b = ev(e.lhs), ev(e.rhs)
        with np.errstate(all="ignore"):
            return {
                "+": np.add,
                "-": np.subtract,
                "*": np.multiply,
                "/": np.true_divide,
                "//": np.floor_divide,
                "%": np.mod,
                "==": np.equal,
                "!=": np.not_equal,
                "<": np.less,
                "<=": np.less_equal,
                ">": np.greater,
                ">=": np.greater_equal,
                "and": np.logical_and,
                "or": np.logical_or,
            }[e.op](a, b)
    if isinstance(e, ir.Where):
        return np.where(ev(e.cond), ev(e.if_true), ev(e.if_false))
    if isinstance(e, ir.Func):
        with np.errstate(all="ignore"):
            return _NUMPY_FUNCTIONS[e.name](*(ev(a) for a in e.args))
    raise AssertionError(f"unhandled IR node {e!r}")


def dense_mask(spec: Spec, batch: int, heads: int, q_len: int, kv_len: int, params: dict) -> np.ndarray:
    """[batch, heads, q_len, kv_len] bool: True where a query attends to a key."""
    shape = (batch, heads, q_len, kv_len)
    if spec.mask is None:
        return np.ones(shape, dtype=bool)
    env = {
        "b": np.arange(batch).reshape(-1, 1, 1, 1),
        "h": np.arange(heads).reshape(1, -1, 1, 1),
        "q_idx": np.arange(q_len).reshape(1, 1, -1, 1),
        "kv_idx": np.arange(kv_len).reshape(1, 1, 1, -1),
        **params,
    }
    return np.broadcast_to(evaluate(spec.mask, env), shape)


def attention_ref(spec: Spec, q, k, v, *, scale: float | None = None, **params) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) in float64 for q [B, H, Lq, D], k, v [B, H, Lk, D] (any array-likes)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    score = scale * np.matmul(q, k.swapaxes(-1, -2))
    if spec.score is not None:
        env = {
            "score": score,
            "b": np.arange(batch).reshape(-1, 1, 1, 1),
            "h": np.arange(heads).reshape(1, -1, 1, 1),
            "q_idx": np.arange(q_len).reshape(1, 1, -1, 1),
            "kv_idx": np.arange(kv_len).reshape(1, 1, 1, -1),
            **params,
        }
        score = np.broadcast_to(evaluate(spec.score, env), score.shape)
    visible = dense_mask(spec, batch, heads, q_len, kv_len, params)
    score = np.where(visible, score, -np.inf)
    row_max = score.max(axis=-1, keepdims=True, initial=-np.inf)
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    p = np.exp(score - shift)
    total = p.sum(axis=-1, keepdims=True)
    out = np.matmul(p / np.where(total == 0, 1.0, total), v)
    with np.errstate(divide="ignore"):
        lse = np.where(total[..., 0] == 0, -np.inf, np.log(total[..., 0]) + shift[..., 0])
    return out, lse
