"""The typed IR of mask and score expressions.

Produced by attngen.lang.typecheck from the AST; consumed by the tile analysis (to sympy), the
reference (numpy evaluation) and the backends (source emission). Every node carries its type;
implicit int -> float promotions are explicit ToFloat nodes, so no consumer has to re-derive
typing rules.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class Type(enum.Enum):
    BOOL = "bool"
    INT = "int"
    FLOAT = "float"


class VarKind(enum.Enum):
    """Where a variable's value comes from at run time."""

    INDEX = "index"  # q_idx, kv_idx, b, h: positions in the attention problem
    SCORE = "score"  # the scaled logit scale * q.k, only inside score expressions
    PARAM = "param"  # a runtime scalar argument declared in [params]
    SIZE = "size"  # q_len, kv_len: the lengths of the query and key sequences
    TILE = "tile"  # q_first, q_last, ...: the block a kernel program works on (tile bounds only)


INDEX_VARS = ("q_idx", "kv_idx", "b", "h")
SIZE_VARS = ("q_len", "kv_len")

# Functions of the language: name -> (arity, result rule).
# "float": result FLOAT, args promoted to FLOAT; "same": result type of the promoted args.
FUNCTIONS = {
    "exp": (1, "float"),
    "log": (1, "float"),
    "sqrt": (1, "float"),
    "tanh": (1, "float"),
    "sin": (1, "float"),
    "cos": (1, "float"),
    "tan": (1, "float"),
    "exp2": (1, "float"),
    "log2": (1, "float"),
    "abs": (1, "same"),
    "min": (2, "same"),
    "max": (2, "same"),
}


@dataclass(frozen=True)
class Expr:
    type: Type


@dataclass(frozen=True)
class Const(Expr):
    value: int | float | bool


@dataclass(frozen=True)
class Var(Expr):
    name: str
    kind: VarKind


@dataclass(frozen=True)
class ToFloat(Expr):
    """An int operand promoted to float."""

    operand: Expr


@dataclass(frozen=True)
class Neg(Expr):
    operand: Expr


@dataclass(frozen=True)
class Not(Expr):
    operand: Expr


@dataclass(frozen=True)
class Arith(Expr):
    """lhs op rhs for op in + - * / // %. `//` and `%` are integer-only with floor semantics."""

    op: str
    lhs: Expr
    rhs: Expr


@dataclass(frozen=True)
class Compare(Expr):
    op: str  # == != < <= > >=
    lhs: Expr
    rhs: Expr


@dataclass(frozen=True)
class Logic(Expr):
    op: str  # and, or
    lhs: Expr
    rhs: Expr


@dataclass(frozen=True)
class Where(Expr):
    cond: Expr
    if_true: Expr
    if_false: Expr


@dataclass(frozen=True)
class Func(Expr):
    name: str  # a key of FUNCTIONS
    args: tuple[Expr, ...]


@dataclass(frozen=True)
class Load(Expr):
    """An element of a tensor param, `tensor[indices]`. Each index is clamped into the tensor's
    extent along its axis (as jnp indexing clamps), so a load never reads outside the tensor.
    An element of a bool tensor is a BOOL load; kernels hold such tensors as 0/1 ints, and the
    passes that reason about values (sympy) read them as `element != 0`."""

    tensor: str  # the param's name
    indices: tuple[Expr, ...]  # int, one per axis


def children(e: Expr) -> tuple[Expr, ...]:
    """Direct sub-expressions of e, in source order."""
    if isinstance(e, (ToFloat, Neg, Not)):
        return (e.operand,)
    if isinstance(e, (Arith, Compare, Logic)):
        return (e.lhs, e.rhs)
    if isinstance(e, Where):
        return (e.cond, e.if_true, e.if_false)
    if isinstance(e, Func):
        return e.args
    if isinstance(e, Load):
        return e.indices
    return ()


def variables(e: Expr) -> frozenset[str]:
    """Names of every variable and tensor e reads."""
    if isinstance(e, Var):
        return frozenset({e.name})
    out: frozenset[str] = frozenset({e.tensor}) if isinstance(e, Load) else frozenset()
    for c in children(e):
        out |= variables(c)
    return out


def is_nonnegative(e: Expr) -> bool:
    """Whether e is provably >= 0 (a cheap syntactic proof; False means "not known").

    Lets targets whose integer // and % truncate (Triton) emit them directly where floor and
    truncation agree, instead of a floor-division helper.
    """
    if isinstance(e, Const):
        return e.type is not Type.BOOL and e.value >= 0
    if isinstance(e, Var):
        return e.kind in (VarKind.INDEX, VarKind.SIZE, VarKind.TILE)
    if isinstance(e, Arith) and e.op in ("+", "*", "//", "%"):
        return is_nonnegative(e.lhs) and is_nonnegative(e.rhs)
    if isinstance(e, Func) and e.name == "max":
        return any(is_nonnegative(a) for a in e.args)
    if isinstance(e, Func) and e.name in ("min", "abs", "exp", "exp2", "sqrt"):
        return e.name != "min" or all(is_nonnegative(a) for a in e.args)
    if isinstance(e, Where):
        return is_nonnegative(e.if_true) and is_nonnegative(e.if_false)
    return False


def uses_floor_division(e: Expr) -> bool:
    """Whether e has a // or % whose operands may be negative (where floor != truncation)."""
    if isinstance(e, Arith) and e.op in ("//", "%") and not (is_nonnegative(e.lhs) and is_nonnegative(e.rhs)):
        return True
    return any(uses_floor_division(c) for c in children(e))


def substitute(e: Expr, replacements: dict[Expr, Expr]) -> Expr:
    """e with every sub-expression that is a key of `replacements` replaced by its value."""
    if e in replacements:
        return replacements[e]
    if not replacements or not children(e):
        return e
    new = tuple(substitute(c, replacements) for c in children(e))
    if isinstance(e, (ToFloat, Neg, Not)):
        return dataclasses.replace(e, operand=new[0])
    if isinstance(e, (Arith, Compare, Logic)):
        return dataclasses.replace(e, lhs=new[0], rhs=new[1])
    if isinstance(e, Where):
        return dataclasses.replace(e, cond=new[0], if_true=new[1], if_false=new[2])
    if isinstance(e, Func):
        return dataclasses.replace(e, args=new)
    if isinstance(e, Load):
        return dataclasses.replace(e, indices=new)
    raise AssertionError(f"unhandled IR node {e!r}")


def loads(e: Expr) -> tuple[Load, ...]:
    """Every tensor load in e, outermost first, without repeats."""
    found = (e,) if isinstance(e, Load) else ()
    for c in children(e):
        found += tuple(x for x in loads(c) if x not in found)
    return found


def reads_positions(e: Expr) -> bool:
    """Whether e reads q_idx or kv_idx (directly or in a tensor's indices): it varies inside a tile."""
    return bool(variables(e) & {"q_idx", "kv_idx"})


def reads_pairs(e: Expr) -> bool:
    """Whether e reads a tensor at each (query, key) pair: a load with one index that reads q_idx and
    not kv_idx, and one that reads kv_idx and not q_idx (a full bias; a relative table reads both in
    one index, a document id one of them)."""
    for load in loads(e):
        axes = [variables(i) & {"q_idx", "kv_idx"} for i in load.indices]
        if {"q_idx"} in axes and {"kv_idx"} in axes:
            return True
    return False


def divisor_params(e: Expr) -> frozenset[str]:
    """Scalar params that e divides by (the right operand of // or %): they must be positive."""
    own = frozenset()
    if isinstance(e, Arith) and e.op in ("//", "%") and isinstance(e.rhs, Var) and e.rhs.kind is VarKind.PARAM:
        own = frozenset({e.rhs.name})
    return own.union(*(divisor_params(c) for c in children(e)))


def uses_function(e: Expr, name: str) -> bool:
    if isinstance(e, Func) and e.name == name:
        return True
    return any(uses_function(c, name) for c in children(e))
