"""IR expression -> source text in a Python-embedded kernel language (Triton, JAX/Pallas).

Only this printer turns IR into code: names come from a fixed mapping supplied by the caller,
literals are re-printed from their values, so no user text reaches generated source verbatim.
Parentheses follow Python's precedence, so the output has no more of them than it needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from attngen import ir
from attngen.ir import Type

# Python precedence levels (higher binds tighter).
_CMP, _OR, _AND, _ADD, _MUL, _UNARY, _ATOM = 5, 6, 8, 10, 11, 12, 14
_ARITH_PREC = {"+": _ADD, "-": _ADD, "*": _MUL, "/": _MUL, "//": _MUL, "%": _MUL}


@dataclass(frozen=True)
class Dialect:
    """How a target spells the language's operations."""

    functions: dict[str, str]  # IR function name -> callable, e.g. "exp" -> "tl.exp"
    where: str | Callable[[str, str, str], str]  # a function's name, or (cond, if true, if false) -> an atom
    logical_not: Callable[[str], str]  # operand source (already atomic) -> source
    to_float: Callable[[str], str]  # operand source (already atomic) -> source
    floordiv: str | None  # helper with floor semantics, or None when `//` already floors
    floormod: str | None
    # A tensor element: (the tensor's name in the target, each index's source) -> source.
    load: Callable[[str, list[str]], str]
    # An index clamped into an axis: (index source, the tensor's name in the target, axis) -> source.
    clamp: Callable[[str, str, int], str]
    logic: tuple[str, str] = ("&", "|")  # spelling of and, or
    infinity: str = 'float("inf")'  # a Python float both kernel languages take as a constant
    # Kernels hold a bool tensor as 0/1 ints (Triton loads them widened, TPU scalar memory and
    # gathered arrays take 32-bit values): an element is read as `element != 0`.
    bools_as_ints: bool = True


# The position variable that spans each axis name of a tensor param exactly.
_AXIS_OF = {"b": "batch", "h": "heads", "q_idx": "q_len", "kv_idx": "kv_len"}


def emit(e: ir.Expr, dialect: Dialect, names: dict[str, str], shapes: dict | None = None) -> str:
    """Source for e; `names` maps every variable e reads to its spelling in the target, `shapes`
    each tensor param to its declared axes.

    A load clamps each index into its axis (the language's rule) except an index that is the
    position variable of that axis (q_idx on a q_len axis, ...): it is in range for every real
    position, and left bare keeps the access contiguous for the compiler.
    """
    return _Printer(dialect, names, shapes or {}).print(e)[0]


def exact_index(index: ir.Expr, axis: int | str) -> bool:
    """Whether index is the position variable that spans `axis` (so needs no clamping)."""
    return isinstance(index, ir.Var) and _AXIS_OF.get(index.name) == axis


@dataclass
class _Printer:
    dialect: Dialect
    names: dict[str, str]
    shapes: dict[str, tuple[int | str, ...]]

    def atom(self, e: ir.Expr) -> str:
        text, prec = self.print(e)
        return text if prec >= _ATOM else f"({text})"

    def operand(self, e: ir.Expr, min_prec: int) -> str:
        text, prec = self.print(e)
        return text if prec >= min_prec else f"({text})"

    def call(self, fn: str, *args: ir.Expr) -> tuple[str, int]:
        return f"{fn}({', '.join(self.print(a)[0] for a in args)})", _ATOM

    def print(self, e: ir.Expr) -> tuple[str, int]:
        d = self.dialect
        if isinstance(e, ir.Const):
            if e.type is Type.FLOAT and math.isinf(e.value):
                text = f"-{d.infinity}" if e.value < 0 else d.infinity
            elif e.type is Type.FLOAT:
                text = repr(float(e.value))
            else:
                text = repr(e.value) if e.type is Type.BOOL else str(int(e.value))
            return text, (_UNARY if text.startswith("-") else _ATOM)
        if isinstance(e, ir.Var):
            return self.names[e.name], _ATOM
        if isinstance(e, ir.ToFloat):
            return d.to_float(self.atom(e.operand)), _ATOM
        if isinstance(e, ir.Neg):
            return f"-{self.operand(e.operand, _UNARY)}", _UNARY
        if isinstance(e, ir.Not):
            return d.logical_not(self.atom(e.operand)), _ATOM
        if isinstance(e, ir.Arith):
            signs_known = ir.is_nonnegative(e.lhs) and ir.is_nonnegative(e.rhs)
            if e.op == "//" and d.floordiv and not signs_known:
                return self.call(d.floordiv, e.lhs, e.rhs)
            if e.op == "%" and d.floormod and not signs_known:
                return self.call(d.floormod, e.lhs, e.rhs)
            prec = _ARITH_PREC[e.op]
            return f"{self.operand(e.lhs, prec)} {e.op} {self.operand(e.rhs, prec + 1)}", prec
        if isinstance(e, ir.Compare):
            return f"{self.operand(e.lhs, _CMP + 1)} {e.op} {self.operand(e.rhs, _CMP + 1)}", _CMP
        if isinstance(e, ir.Logic):
            op, prec = (d.logic[0], _AND) if e.op == "and" else (d.logic[1], _OR)
            return f"{self.operand(e.lhs, prec)} {op} {self.operand(e.rhs, prec + 1)}", prec
        if isinstance(e, ir.Where):
            if callable(d.where):
                return d.where(*(self.print(x)[0] for x in (e.cond, e.if_true, e.if_false))), _ATOM
            return self.call(d.where, e.cond, e.if_true, e.if_false)
        if isinstance(e, ir.Func):
            return self.call(d.functions[e.name], *e.args)
        if isinstance(e, ir.Load):
            tensor, axes = self.names[e.tensor], self.shapes.get(e.tensor, ())
            indices = [
                text if k < len(axes) and exact_index(index, axes[k]) else d.clamp(text, tensor, k)
                for k, (index, text) in enumerate((i, self.print(i)[0]) for i in e.indices)
            ]
            if e.type is Type.BOOL and d.bools_as_ints:
                return f"{d.load(tensor, indices)} != 0", _CMP
            return d.load(tensor, indices), _ATOM
        raise AssertionError(f"unhandled IR node {e!r}")
