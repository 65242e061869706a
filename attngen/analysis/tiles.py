"""Stage: mask IR -> per-q-block loop bounds over kv blocks, as IR expressions.

For a q block holding rows [q_first, q_last] a kernel visits kv blocks [kv_lo, kv_hi); every block
outside is EMPTY (no visible key) and is neither loaded nor computed. Inside, blocks
[full_lo, full_hi) are FULL (every key visible to every row): they run with no mask code. The
rest are PARTIAL and evaluate the mask. Both templates run exactly these expressions.

Goals:
  * closed-form bounds for conjunctions and disjunctions of atoms `r(q_idx) <= k` / `k <= r(q_idx)`
    where k is kv_idx or kv_idx // d (d > 0: chunks) and r is monotone in q_idx (a*q_idx,
    q_idx // d, plus terms of int params, b, h, the lengths, and int tensors read at b and h such
    as a per-batch prefix[b]), and of q-only conditions -- causal either way aligned, sliding and
    local windows, chunks, prefix-LM and their and/or combinations;
  * soundness for everything else: an atom sympy cannot bound makes its tiles PARTIAL, never
    wrongly EMPTY or FULL.
Non-goals: masks that read tensors at each position (document masks) have no closed form: the
templates build block tables for them at run time (plan.block_tables);
bounds are intervals, so a mask with holes (e.g. dilated) is visited over its hull.

Method: the mask becomes a sympy boolean in negation normal form; each atom is solved for kv_idx
and turned into two intervals of key positions per q block, `visit` (keys some row may see) and
`full` (keys all rows see); `and` intersects, `or` takes the hull of `visit` and the largest union
it can prove of `full`. Intervals become block indices with clamping that keeps every division
on non-negative numbers (so C truncation and floor division agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, reduce

import sympy

from attngen import ir
from attngen.ir import Type, VarKind
from attngen.ir_sympy import is_tensor_load, to_sympy

# The pass is written for one orientation: a block of "rows" (a program's fixed block) against
# the "columns" its loop walks. The forward pass and dQ use rows = queries, columns = keys; dK/dV
# use rows = keys, columns = queries. Symbols are generic; Orientation names them for emission.
Q = sympy.Symbol("row", integer=True)
K = sympy.Symbol("col", integer=True)
Q_FIRST = sympy.Symbol("row_first", integer=True, nonnegative=True)
Q_LAST = sympy.Symbol("row_last", integer=True, nonnegative=True)
KV_LEN = sympy.Symbol("col_len", integer=True, positive=True)
ROW_LEN = sympy.Symbol("row_len", integer=True, positive=True)
# Each bound may read the ones computed before it, in this order.
KV_LO = sympy.Symbol("col_lo", integer=True, nonnegative=True)
KV_HI = sympy.Symbol("col_hi", integer=True, nonnegative=True)
FULL_LO = sympy.Symbol("full_lo", integer=True, nonnegative=True)


@dataclass(frozen=True, eq=False)  # two of them, below: equal when the same (and hashable)
class Orientation:
    """Which index the rows are, and what the generic symbols are called in kernels."""

    row_var: str  # "q_idx" or "kv_idx"
    col_var: str
    names: dict[str, str]  # generic symbol name -> kernel variable name

    @property
    def tile_vars(self) -> tuple[str, ...]:
        return tuple(self.names.values())


BY_QUERY_BLOCK = Orientation(
    "q_idx",
    "kv_idx",
    {
        "row_first": "q_first",
        "row_last": "q_last",
        "row_len": "q_len",
        "col_len": "kv_len",
        "col_lo": "kv_lo",
        "col_hi": "kv_hi",
        "full_lo": "full_lo",
    },
)
BY_KEY_BLOCK = Orientation(
    "kv_idx",
    "q_idx",
    {
        "row_first": "kv_first",
        "row_last": "kv_last",
        "row_len": "kv_len",
        "col_len": "q_len",
        "col_lo": "q_lo",
        "col_hi": "q_hi",
        "full_lo": "q_full_lo",
    },
)
TILE_VARS = tuple(dict.fromkeys((*BY_QUERY_BLOCK.tile_vars, *BY_KEY_BLOCK.tile_vars)))


@dataclass(frozen=True)
class TileBounds:
    """Column block ranges for one row block: visit [lo, hi), of which [full_lo, full_hi) FULL.

    Int IR over the row block's first/last position, the column length, b, h and params.
    """

    lo: ir.Expr
    hi: ir.Expr
    full_lo: ir.Expr
    full_hi: ir.Expr
    affine: bool  # whether every atom of the mask was bounded in closed form


@dataclass(frozen=True)
class _Interval:
    """Inclusive range [lo, hi] of key positions; empty when lo > hi."""

    lo: sympy.Expr
    hi: sympy.Expr


_ALL = _Interval(sympy.Integer(0), KV_LEN - 1)
_NONE = _Interval(sympy.Integer(0), sympy.Integer(-1))


class FloorDiv(sympy.Function):
    """a // b with b > 0, left unevaluated on symbols so it can be emitted as it is."""

    nargs = 2
    is_integer = True

    def _eval_is_nonnegative(self):
        return self.args[0].is_nonnegative

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        if a == 0 or (b.is_positive and a == b - 1):  # 0 <= a < b, for a block size b not yet known
            return sympy.Integer(0)
        return None


class _Unsupported(Exception):
    """A bound took a form this pass cannot emit; the caller falls back to visiting everything."""


def _int_ir(x: sympy.Basic, kinds: dict[str, tuple[str, VarKind]]) -> ir.Expr:
    """IR of an integer sympy expression built by this pass (bounds only); kinds maps each
    symbol's name to the variable it becomes."""
    rec = lambda y: _int_ir(y, kinds)
    if x.is_Integer:
        return ir.Const(Type.INT, int(x))
    if x.is_Symbol:
        if x.name not in kinds:  # (the literal inf: atoms reading it are never bounded)
            raise _Unsupported(x)
        return ir.Var(Type.INT, *kinds[x.name])
    if is_tensor_load(x):  # an int tensor read at program-constant indices, e.g. prefix[b]
        return ir.Load(Type.INT, x.func.__name__, tuple(rec(a) for a in x.args))
    if isinstance(x, sympy.Add):
        # Positive symbolic terms first, then subtracted ones, constants last: `q_last + 1 - w`.
        terms = sorted(x.args, key=lambda t: (t.is_Number, t.could_extract_minus_sign(), sympy.default_sort_key(t)))
        out = rec(terms[0])
        for t in terms[1:]:
            if t.could_extract_minus_sign():
                out = ir.Arith(Type.INT, "-", out, rec(-t))
            else:
                out = ir.Arith(Type.INT, "+", out, rec(t))
        return out
    if isinstance(x, sympy.Mul):
        coeff, rest = x.as_coeff_Mul()
        if coeff == -1:
            return ir.Neg(Type.INT, rec(rest))
        if coeff != 1:
            return ir.Arith(Type.INT, "*", rec(coeff), rec(rest))
        factors = sympy.Mul.make_args(rest)  # symbolic factors, e.g. chunk * floor(...)
        return reduce(lambda a, b: ir.Arith(Type.INT, "*", a, b), (rec(f) for f in factors))
    if isinstance(x, (sympy.Max, sympy.Min)):
        name = "max" if isinstance(x, sympy.Max) else "min"
        args = sorted(x.args, key=sympy.default_sort_key)
        return reduce(lambda a, b: ir.Func(Type.INT, name, (a, b)), (rec(a) for a in args))
    if isinstance(x, FloorDiv):
        return ir.Arith(Type.INT, "//", rec(x.args[0]), rec(x.args[1]))
    if isinstance(x, sympy.floor):  # from a chunked mask: floor((row + e) / d), d > 0
        numerator, denominator = sympy.fraction(sympy.together(x.args[0]))
        return ir.Arith(Type.INT, "//", rec(numerator), rec(denominator))
    if isinstance(x, sympy.Piecewise):
        (value, cond), *rest = x.args
        if cond is sympy.true or not rest:
            return rec(value)
        return ir.Where(Type.INT, _bool_ir(cond, kinds), rec(value), rec(sympy.Piecewise(*rest)))
    raise _Unsupported(x)


def _bool_ir(c: sympy.Basic, kinds: dict[str, tuple[str, VarKind]]) -> ir.Expr:
    if c is sympy.true or c is sympy.false:
        return ir.Const(Type.BOOL, bool(c))
    if isinstance(c, sympy.ITE):  # from a comparison of piecewise bounds
        cond, if_true, if_false = (_bool_ir(a, kinds) for a in c.args)
        return ir.Where(Type.BOOL, cond, if_true, if_false)
    if isinstance(c, sympy.Not):
        return ir.Not(Type.BOOL, _bool_ir(c.args[0], kinds))
    if isinstance(c, (sympy.And, sympy.Or)):
        op = "and" if isinstance(c, sympy.And) else "or"
        args = sorted(c.args, key=sympy.default_sort_key)
        return reduce(lambda a, b: ir.Logic(Type.BOOL, op, a, b), (_bool_ir(a, kinds) for a in args))
    ops = {sympy.Ge: ">=", sympy.Gt: ">", sympy.Le: "<=", sympy.Lt: "<", sympy.Eq: "==", sympy.Ne: "!="}
    if type(c) not in ops:
        raise _Unsupported(c)
    return ir.Compare(Type.BOOL, ops[type(c)], _int_ir(c.lhs, kinds), _int_ir(c.rhs, kinds))


# ---------------------------------------------------------------------------- interval algebra


def _intersect(xs: list[_Interval]) -> _Interval:
    return _Interval(sympy.Max(*(x.lo for x in xs)), sympy.Min(*(x.hi for x in xs)))


def _hull(xs: list[_Interval]) -> _Interval:
    return _Interval(sympy.Min(*(x.lo for x in xs)), sympy.Max(*(x.hi for x in xs)))


def _inner_union(a: _Interval, b: _Interval) -> _Interval:
    """An interval inside a ∪ b: their hull when they overlap or touch, else the longer one.

    Sound for empty inputs too: if a is empty and the touch test passes, the hull equals b.
    """
    if b == _NONE or a == _NONE:
        return a if b == _NONE else b
    if a.lo == b.lo:  # [lo, x] ∪ [lo, y] = [lo, max(x, y)], empty sides included
        return _Interval(a.lo, sympy.Max(a.hi, b.hi))
    if a.hi == b.hi:
        return _Interval(sympy.Min(a.lo, b.lo), a.hi)
    if _size(a) + _size(b) > _SIZE_BUDGET:
        return a  # keep compile time bounded: a alone is inside the union, just less tight
    touch = sympy.Max(a.lo, b.lo) <= sympy.Min(a.hi, b.hi) + 1
    a_longer = a.hi - a.lo >= b.hi - b.lo
    hull = _hull([a, b])
    lo = sympy.Piecewise((hull.lo, touch), (a.lo, a_longer), (b.lo, True))
    hi = sympy.Piecewise((hull.hi, touch), (a.hi, a_longer), (b.hi, True))
    return _Interval(lo, hi)


# Bounds past this many sympy operations are not refined further (see _inner_union, _tidy):
# sympy's min/max simplification grows quickly with nested piecewise terms.
_SIZE_BUDGET = 40


def _size(x: _Interval | sympy.Basic) -> int:
    if isinstance(x, _Interval):
        return sympy.count_ops(x.lo) + sympy.count_ops(x.hi)
    return sympy.count_ops(x)


def _floor_of(term: sympy.Basic, var: sympy.Symbol) -> tuple[sympy.Expr, sympy.Expr] | None:
    """(e, d) when term is floor((var + e) / d) with d > 0 and e free of var, else None."""
    if not isinstance(term, sympy.floor):
        return None
    numerator, denominator = sympy.fraction(sympy.together(term.args[0]))
    e = sympy.expand(numerator - var)
    if denominator.is_positive and not e.has(var) and not denominator.has(var):
        return e, denominator
    return None


def _extremes(g: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr] | None:
    """(min, max) of g over the row block's rows, when g is monotone in the row: terms free of it,
    plus a*row and a*floor((row + e) / d) (d > 0) terms whose coefficients a share one sign.
    None otherwise (the atom is then not bounded in closed form)."""
    increasing = set()
    for term in sympy.Add.make_args(sympy.expand(g)):
        if not term.has(Q):
            continue
        factors = [f for f in sympy.Mul.make_args(term) if f.has(Q)]
        if len(factors) != 1 or not (factors[0] == Q or _floor_of(factors[0], Q)):
            return None
        coefficient = term / factors[0]
        if coefficient.is_positive is None and coefficient.is_negative is None:
            return None
        increasing.add(bool(coefficient.is_positive))
    at_first, at_last = g.subs(Q, Q_FIRST), g.subs(Q, Q_LAST)
    return (at_last, at_first) if increasing == {False} else (at_first, at_last)


def _all_or_none(condition: sympy.Basic) -> _Interval:
    """Every key if condition holds, else the empty interval [kv_len, -1]: its ends are neutral
    in a hull (or), so an `or` with a false row-only condition keeps the other side's bounds."""
    return _Interval(
        sympy.Piecewise((0, condition), (KV_LEN, True)), sympy.Piecewise((KV_LEN - 1, condition), (-1, True))
    )


def _atom(diff: sympy.Expr) -> tuple[_Interval, _Interval] | None:
    """(visit, full) for the atom diff >= 0, or None if it cannot be solved for kv_idx in closed form.

    Solvable: diff = s * k + r(row) with s = +-1, where k is kv_idx or floor((kv_idx + e) / d)
    (d > 0: chunked masks) and r is monotone in the row (see _extremes). Floors are undone exactly
    for integers: floor(x / d) <= r  <=>  x <= d * r + d - 1, and floor(x / d) >= r  <=>  x >= d * r.
    """
    terms = sympy.Add.make_args(sympy.expand(diff))
    col_terms = [t for t in terms if t.has(K)]
    rest = sympy.Add(*(t for t in terms if not t.has(K)))
    if not rest.is_integer:
        return None
    if not col_terms:  # a condition on the row alone: every key of the row or none
        if (extremes := _extremes(rest)) is None:
            return None
        low, high = extremes
        return _all_or_none(high >= 0), _all_or_none(low >= 0)
    if len(col_terms) != 1:
        return None
    sign, col = col_terms[0].as_coeff_Mul()
    if sign not in (1, -1):
        return None  # |s| > 1 would need floor division of signed values: left to the mask code
    if col == K:
        lower, upper = -rest, rest  # s = 1: kv_idx >= -r; s = -1: kv_idx <= r
    elif (floor := _floor_of(col, K)) is not None:
        e, d = floor
        lower, upper = -d * rest - e, d * rest + d - 1 - e
    else:
        return None
    if sign == 1:  # kv_idx >= lower(row)
        if (extremes := _extremes(lower)) is None:
            return None
        low, high = extremes
        return _Interval(low, KV_LEN - 1), _Interval(high, KV_LEN - 1)
    if (extremes := _extremes(upper)) is None:  # kv_idx <= upper(row)
        return None
    low, high = extremes
    return _Interval(sympy.Integer(0), high), _Interval(sympy.Integer(0), low)


def _relation(rel: sympy.Basic) -> sympy.Basic:
    """Rewrite a relational as and/or of `diff >= 0` atoms (integers make strictness exact)."""
    lhs, rhs = rel.lhs, rel.rhs
    if not (lhs.is_integer and rhs.is_integer):
        return rel
    ge = lambda d: sympy.Ge(d, 0, evaluate=False)
    if isinstance(rel, sympy.Ge):
        return ge(lhs - rhs)
    if isinstance(rel, sympy.Gt):
        return ge(lhs - rhs - 1)
    if isinstance(rel, sympy.Le):
        return ge(rhs - lhs)
    if isinstance(rel, sympy.Lt):
        return ge(rhs - lhs - 1)
    if isinstance(rel, sympy.Eq):
        return sympy.And(ge(lhs - rhs), ge(rhs - lhs), evaluate=False)
    if isinstance(rel, sympy.Ne):
        return sympy.Or(ge(lhs - rhs - 1), ge(rhs - lhs - 1), evaluate=False)
    return rel


class _Bounder:
    def __init__(self):
        self.affine = True

    def bound(self, m: sympy.Basic) -> tuple[_Interval, _Interval]:
        if m is sympy.true:
            return _ALL, _ALL
        if m is sympy.false:
            return _NONE, _NONE
        if isinstance(m, sympy.And):
            parts = [self.bound(x) for x in m.args]
            return _intersect([p[0] for p in parts]), _intersect([p[1] for p in parts])
        if isinstance(m, sympy.Or):
            parts = [self.bound(x) for x in m.args]
            return _hull([p[0] for p in parts]), reduce(_inner_union, (p[1] for p in parts))
        if isinstance(m, sympy.Ge) and m.rhs == 0:
            if (result := _atom(m.lhs)) is not None:
                return result
        elif isinstance(m, sympy.Rel) and (rewritten := _relation(m)) is not m:
            return self.bound(rewritten)
        # Anything else (floor, mod, float coefficients, products of indices...): every kv block
        # may hold visible keys, and none is known to be full.
        self.affine = False
        return _ALL, _NONE


def _tidy(x: sympy.Basic) -> sympy.Basic:
    """Distribute sums over min/max (c + min(a, b) -> min(c + a, c + b)) so that sympy can drop
    dominated arguments, e.g. min(kv_len, min(q_last, kv_len - 1) + 1) -> min(kv_len, q_last + 1)."""
    if x.is_Atom or x.has(sympy.Piecewise) or _size(x) > _SIZE_BUDGET:
        return x
    args = [_tidy(a) for a in x.args]
    if isinstance(x, sympy.Add):
        for i, a in enumerate(args):
            if isinstance(a, (sympy.Min, sympy.Max)):
                rest = sympy.Add(*args[:i], *args[i + 1 :])
                return _tidy(a.func(*(rest + t for t in a.args)))
    return x.func(*args)


def _blocks(visit: _Interval, full: _Interval, block_kv: int | str) -> tuple[sympy.Expr, ...]:
    """Key intervals -> kv block ranges; every division has a non-negative numerator."""
    bn = sympy.Integer(block_kv) if isinstance(block_kv, int) else sympy.Symbol(block_kv, integer=True, positive=True)
    kv_lo = FloorDiv(_tidy(sympy.Max(visit.lo, 0)), bn)
    kv_hi = FloorDiv(_tidy(sympy.Min(sympy.Max(visit.hi + 1, 0), KV_LEN) + bn - 1), bn)
    full_lo = sympy.Min(sympy.Max(FloorDiv(_tidy(sympy.Max(full.lo, 0) + bn - 1), bn), KV_LO), KV_HI)
    # Floor of the end keeps a kv tail block (kv_len % block_kv != 0) out of the FULL run:
    # it needs bounds masking anyway.
    full_hi = sympy.Min(sympy.Max(FloorDiv(_tidy(sympy.Min(sympy.Max(full.hi + 1, 0), KV_LEN)), bn), FULL_LO), KV_HI)
    return kv_lo, kv_hi, full_lo, full_hi


def analyse_mask(
    mask: ir.Expr | None, params: dict[str, Type], block: int | str, orientation: Orientation = BY_QUERY_BLOCK
) -> TileBounds:
    """Column block ranges of `mask` (None: no mask) for column blocks of `block` positions: a
    number, or the name of the kernel constant that holds it (one kernel then serves any block
    size, and the launch may pick one per call).

    With BY_QUERY_BLOCK (the default) the result reads q_first, q_last, kv_len and gives kv block
    ranges; with BY_KEY_BLOCK it reads kv_first, kv_last, q_len and gives q block ranges.
    """
    return _analyse_mask(mask, tuple(sorted(params.items())), block, orientation)


@cache
def _analyse_mask(
    mask: ir.Expr | None, params: tuple[tuple[str, Type], ...], block: int | str, orientation: Orientation
) -> TileBounds:
    """analyse_mask, once a process per question: sympy takes 0.1-1 s, and every load of a module
    (attngen.load renders its source to find it in the cache) asks again."""
    params = dict(params)
    symbols = {
        orientation.row_var: Q,
        orientation.col_var: K,
        orientation.names["row_len"]: ROW_LEN,
        orientation.names["col_len"]: KV_LEN,
        "b": sympy.Symbol("b", integer=True, nonnegative=True),
        "h": sympy.Symbol("h", integer=True, nonnegative=True),
        **{
            n: sympy.Symbol(n, integer=True) if t is Type.INT else sympy.Symbol(n, real=True) for n, t in params.items()
        },
    }
    # A param that divides is positive: the generated functions refuse anything else (DIVISORS).
    divisors = ir.divisor_params(mask) if mask is not None else frozenset()
    symbols |= {n: sympy.Symbol(n, integer=True, positive=True) for n in divisors if n in params}
    bounder = _Bounder()
    if mask is None:
        visit, full = _ALL, _ALL
    else:
        visit, full = bounder.bound(sympy.to_nnf(to_sympy(mask, symbols), simplify=False))
    kinds = {
        **{n: (n, VarKind.INDEX) for n in ("b", "h")},
        **{n: (n, VarKind.PARAM) for n in params},
        **{generic: (name, VarKind.TILE) for generic, name in orientation.names.items()},
        **({block: (block, VarKind.TILE)} if isinstance(block, str) else {}),
    }
    try:
        exprs = [_int_ir(x, kinds) for x in _blocks(visit, full, block)]
    except _Unsupported:
        exprs = [_int_ir(x, kinds) for x in _blocks(_ALL, _NONE, block)]
        return TileBounds(*exprs, affine=False)
    return TileBounds(*exprs, affine=bounder.affine)
