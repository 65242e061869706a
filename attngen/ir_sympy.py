"""IR <-> sympy: the symbolic form of an IR expression, for the passes that reason about it.

The type checker folds constants and proves divisors positive with it, the tile analysis solves
masks for kv_idx, the derivative pass differentiates scores. Integers stay exact and `//`, `%`
keep floor semantics; a tensor param is an undefined function of its indices.
"""

from __future__ import annotations

import sympy
from sympy.core.function import AppliedUndef

from attngen import ir
from attngen.ir import Type


def tensor_function(name: str, element: Type) -> sympy.FunctionClass:
    """The undefined sympy function standing for tensor param `name`: sympy knows nothing of its
    values but their type, so a load is an opaque integer or real of its indices."""
    return sympy.Function(name, integer=True) if element is Type.INT else sympy.Function(name, real=True)


def is_tensor_load(x: sympy.Basic) -> bool:
    return isinstance(x, AppliedUndef)


def to_sympy(e: ir.Expr, symbols: dict[str, sympy.Symbol]) -> sympy.Basic:
    """The sympy form of an IR expression (integers exact, floor semantics for // and %)."""
    rec = lambda x: to_sympy(x, symbols)
    if isinstance(e, ir.Const):
        if e.type is Type.BOOL:
            return sympy.true if e.value else sympy.false
        return sympy.Integer(e.value) if e.type is Type.INT else sympy.Float(e.value)
    if isinstance(e, ir.Var):
        return symbols[e.name]
    if isinstance(e, ir.ToFloat):
        return rec(e.operand)
    if isinstance(e, ir.Neg):
        return -rec(e.operand)
    if isinstance(e, ir.Not):
        return sympy.Not(rec(e.operand))
    if isinstance(e, ir.Arith):
        a, b = rec(e.lhs), rec(e.rhs)
        return {
            "+": lambda: a + b,
            "-": lambda: a - b,
            "*": lambda: a * b,
            "/": lambda: a / b,
            "//": lambda: sympy.floor(a / b),
            "%": lambda: sympy.Mod(a, b),
        }[e.op]()
    if isinstance(e, ir.Compare):
        a, b = rec(e.lhs), rec(e.rhs)
        if e.type is Type.BOOL and e.lhs.type is Type.BOOL:
            return sympy.Equivalent(a, b) if e.op == "==" else sympy.Xor(a, b)
        return {
            "==": sympy.Eq,
            "!=": sympy.Ne,
            "<": sympy.Lt,
            "<=": sympy.Le,
            ">": sympy.Gt,
            ">=": sympy.Ge,
        }[e.op](a, b)
    if isinstance(e, ir.Logic):
        return (sympy.And if e.op == "and" else sympy.Or)(rec(e.lhs), rec(e.rhs))
    if isinstance(e, ir.Where):
        c, a, b = rec(e.cond), rec(e.if_true), rec(e.if_false)
        if e.type is Type.BOOL:
            return sympy.Or(sympy.And(c, a), sympy.And(sympy.Not(c), b))
        return sympy.Piecewise((a, c), (b, True))
    if isinstance(e, ir.Load):
        return tensor_function(e.tensor, e.type)(*(rec(i) for i in e.indices))
    if isinstance(e, ir.Func):
        args = [rec(a) for a in e.args]
        return {
            "exp": sympy.exp,
            "log": sympy.log,
            "sqrt": sympy.sqrt,
            "tanh": sympy.tanh,
            "abs": sympy.Abs,
            "min": sympy.Min,
            "max": sympy.Max,
        }[e.name](*args)
    raise AssertionError(f"unhandled IR node {e!r}")
