"""IR <-> sympy: the symbolic form of an IR expression, for the passes that reason about it.

The type checker folds constants and proves divisors positive with it, the tile analysis solves
masks for kv_idx, the derivative pass differentiates scores. Integers stay exact and `//`, `%`
keep floor semantics; a tensor param is an undefined function of its indices (a bool tensor: an
integer one, read as `element != 0`). The literal inf is the positive symbol INFINITY.
"""

from __future__ import annotations

import math

import sympy
from sympy.core.function import AppliedUndef

from attngen import ir
from attngen.ir import Type

# The literal inf, as a positive symbol rather than sympy's oo: sympy's rules for oo are not all
# sound (it takes min(x, where(c, -oo, oo)) for the where, whatever x), and a symbol keeps each
# pass on the safe side: a relation with it gets no closed-form tile bound, a derivative treats
# it as the constant it is, and the type checker's search for infinities that arise (a division
# by 0) does not take it for one.
INFINITY = sympy.Symbol("inf", positive=True)


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
        if e.type is Type.FLOAT and math.isinf(e.value):
            return INFINITY if e.value > 0 else -INFINITY
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
        element = tensor_function(e.tensor, Type.INT if e.type is Type.BOOL else e.type)(*(rec(i) for i in e.indices))
        return sympy.Ne(element, 0) if e.type is Type.BOOL else element
    if isinstance(e, ir.Func):
        args = [rec(a) for a in e.args]
        return {
            "exp": sympy.exp,
            "log": sympy.log,
            "sqrt": sympy.sqrt,
            "tanh": sympy.tanh,
            "sin": sympy.sin,
            "cos": sympy.cos,
            "tan": sympy.tan,
            "exp2": lambda x: sympy.Integer(2) ** x,
            "log2": lambda x: sympy.log(x, 2),
            "abs": sympy.Abs,
            "min": sympy.Min,
            "max": sympy.Max,
        }[e.name](*args)
    raise AssertionError(f"unhandled IR node {e!r}")
