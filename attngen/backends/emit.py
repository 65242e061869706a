"""IR expression -> source text in a Python-embedded kernel language (Triton, JAX/Pallas).

Only this printer turns IR into code: names come from a fixed mapping supplied by the caller,
literals are re-printed from their values, so no user text reaches generated source verbatim.
Parentheses follow Python's precedence, so the output has no more of them than it needs.
"""

from __future__ import annotations

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
    where: str
    logical_not: Callable[[str], str]  # operand source (already atomic) -> source
    to_float: Callable[[str], str]  # operand source (already atomic) -> source
    floordiv: str | None  # helper with floor semantics, or None when `//` already floors
    floormod: str | None
    logic: tuple[str, str] = ("&", "|")  # spelling of and, or


def emit(e: ir.Expr, dialect: Dialect, names: dict[str, str]) -> str:
    """Source for e; `names` maps every variable e reads to its spelling in the target."""
    return _Printer(dialect, names).print(e)[0]


@dataclass
class _Printer:
    dialect: Dialect
    names: dict[str, str]

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
            if e.type is Type.FLOAT:
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
            return self.call(d.where, e.cond, e.if_true, e.if_false)
        if isinstance(e, ir.Func):
            return self.call(d.functions[e.name], *e.args)
        raise AssertionError(f"unhandled IR node {e!r}")
