"""Stage: score expression IR -> IR of its derivatives, via sympy: d(score')/d(score), and
d(score')/d(read) for each read of a tensor param the spec trains ([grad] params).

Goals: the backward pass needs f'(score) for a score modifier score' = f(score, q_idx, kv_idx,
b, h, params), and a trained tensor's gradient needs the derivative by each of its reads. sympy
differentiates the expression (a read is an opaque function of its indices) and simplifies the
result; this pass turns it back into IR that both backends print like any other expression.
Non-goals: gradients of scalar params, and of reads whose indices read positions other than as
the pair's own position or through one index of q_idx - kv_idx alone.

Subgradients at kinks are documented choices: abs'(0) = 0 (sign), max/min split 1/2 each at a
tie (Heaviside(0) = 1/2), where(c, a, b)' = where(c, a', b') (the condition's boundary is ignored).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import sympy

from attngen import ir
from attngen.errors import AttngenError
from attngen.ir import Type, VarKind
from attngen.ir_sympy import INFINITY, is_tensor_load, to_sympy

SCORE = sympy.Symbol("score", real=True)


class DerivativeError(AttngenError):
    """The derivative of a score expression has a form attngen cannot emit."""


def score_derivative(score: ir.Expr, params: dict[str, Type]) -> ir.Expr:
    """IR of d(score)/d(score) for a score expression (a FLOAT expression of `score`)."""
    symbols, converter = _sympy_names(params)
    # factor_terms is the light simplification that keeps the functions of the language (simplify
    # would turn 1 - tanh(x)**2 into 1/cosh(x)**2, which the language cannot spell).
    derivative = sympy.factor_terms(sympy.diff(to_sympy(score, symbols), SCORE))
    return converter.float(derivative)


def _sympy_names(params: dict[str, Type]) -> tuple[dict[str, sympy.Symbol], _Converter]:
    """The sympy symbol of each name an expression may read, and the converter that takes sympy
    expressions over them back to IR."""
    symbols = {
        "score": SCORE,
        **{n: sympy.Symbol(n, integer=True, nonnegative=True) for n in ir.INDEX_VARS},
        **{n: sympy.Symbol(n, integer=True, positive=True) for n in ir.SIZE_VARS},
        **{
            n: sympy.Symbol(n, integer=True) if t is Type.INT else sympy.Symbol(n, real=True) for n, t in params.items()
        },
    }
    kinds = {"score": VarKind.SCORE, **{n: VarKind.INDEX for n in ir.INDEX_VARS}, **{n: VarKind.PARAM for n in params}}
    kinds |= {n: VarKind.SIZE for n in ir.SIZE_VARS}
    return symbols, _Converter(kinds)


# A positional read names the problem's axes in this order, each with the size it must declare.
_POSITIONAL_AXES = {"b": "batch", "h": "heads", "q_idx": "q_len", "kv_idx": "kv_len"}


# The kinds of trained read, each with its own reduction in the kernels (see ParamGradient).
SUMMED, POSITIONAL, RELATIVE = "summed", "positional", "relative"
# q_idx - kv_idx, which a relative read's index is a function of; no param can take its name.
DISTANCE = "#distance"


@dataclass(frozen=True)
class ParamGradient:
    """One read of a trained tensor param in the score: its share of the param's gradient is
    sum over the (query, key) pairs of dL/d(score') * derivative, gathered at the read's index.

    kind: SUMMED, its indices read no position (slopes[h], bound[b]): one element per program,
    which sums its pairs. POSITIONAL, its indices are the pair's own b, h, q_idx, kv_idx (each pair
    reads its own element: the kernels write dL/d(score') * derivative per pair). RELATIVE, one
    index (relative_axis) reads the positions through q_idx - kv_idx alone, the others none
    (rel_bias[h, q_idx - kv_idx + max_dist]): the pairs of a diagonal read one element, so each
    program sums its tiles' diagonals and gathers them into the entries they read."""

    load: ir.Load
    derivative: ir.Expr
    kind: str
    relative_axis: int | None = None
    relative_index: ir.Expr | None = None  # the index on that axis, over DISTANCE


def param_gradients(
    score: ir.Expr, params: dict[str, Type], shapes: dict[str, tuple], trained: tuple[str, ...]
) -> tuple[ParamGradient, ...]:
    """The reads of the `trained` tensor params in a score expression, each with its derivative."""
    symbols, converter = _sympy_names(params)
    expression = to_sympy(score, symbols)
    gradients = []
    for load in ir.loads(score):
        if load.tensor not in trained:
            continue
        kind, axis = _kind(load, shapes[load.tensor], symbols)
        derivative = sympy.factor_terms(sympy.diff(expression, to_sympy(load, symbols)))
        relative_index = _over_the_distance(load.indices[axis]) if kind == RELATIVE else None
        gradients.append(ParamGradient(load, converter.float(derivative), kind, axis, relative_index))
    return tuple(gradients)


def _kind(load: ir.Load, shape: tuple, symbols: dict) -> tuple[str, int | None]:
    """A trained read's kind, and a relative read's axis (see ParamGradient); raises for reads of no kind."""
    positions = [{"q_idx", "kv_idx"} & ir.variables(i) for i in load.indices]
    if not any(positions):
        return SUMMED, None
    names = [i.name if isinstance(i, ir.Var) else None for i in load.indices]
    axes = [_POSITIONAL_AXES.get(n) for n in names]
    own = None not in axes and "q_len" in axes and "kv_len" in axes  # the pair's own position...
    if own and names == sorted(names, key=list(_POSITIONAL_AXES).index):  # ...in the axes' order
        if tuple(shape) != tuple(axes):
            raise DerivativeError(
                f"param {load.tensor}: read at [{', '.join(names)}], it must be declared "
                f"float[{', '.join(axes)}] to be trained (each pair its own element), "
                f"not float[{', '.join(map(str, shape))}]"
            )
        return POSITIONAL, None
    reading = [axis for axis, read in enumerate(positions) if read]
    if len(reading) == 1 and _reads_the_distance_alone(load.indices[reading[0]], symbols):
        return RELATIVE, reading[0]
    raise DerivativeError(
        f"param {load.tensor}: a trained tensor is read at indices that read no position (e.g. {load.tensor}[h]), "
        f"at the pair's own (b, h,) q_idx, kv_idx in this order (e.g. {load.tensor}[b, h, q_idx, kv_idx]), or with "
        f"one index of q_idx - kv_idx alone (e.g. {load.tensor}[h, q_idx - kv_idx + max_dist]); "
        "this read has other indices"
    )


def _reads_the_distance_alone(index: ir.Expr, symbols: dict) -> bool:
    """Whether an index reads q_idx and kv_idx only through q_idx - kv_idx."""
    kv_idx = symbols["kv_idx"]
    moved = to_sympy(index, symbols).subs(symbols["q_idx"], kv_idx + sympy.Symbol("distance", integer=True))
    return kv_idx not in moved.free_symbols or kv_idx not in sympy.simplify(moved).free_symbols


def _over_the_distance(index: ir.Expr) -> ir.Expr:
    """An index that reads q_idx and kv_idx only through q_idx - kv_idx, over DISTANCE: its
    q_idx - kv_idx replaced; where the positions appear apart, q_idx by DISTANCE and kv_idx by 0
    (the same value). IR, not sympy's form, so floor divisions stay integer ones."""
    q_idx, kv_idx = (ir.Var(Type.INT, name, VarKind.INDEX) for name in ("q_idx", "kv_idx"))
    distance = ir.Var(Type.INT, DISTANCE, VarKind.PARAM)  # (its sign is unknown)
    index = ir.substitute(index, {ir.Arith(Type.INT, "-", q_idx, kv_idx): distance})
    return ir.substitute(index, {q_idx: distance, kv_idx: ir.Const(Type.INT, 0)})


class _Converter:
    def __init__(self, kinds: dict[str, VarKind]):
        self.kinds = kinds

    def float(self, x: sympy.Basic) -> ir.Expr:
        e = self.any(x)
        if e.type is Type.INT:
            return ir.Const(Type.FLOAT, float(e.value)) if isinstance(e, ir.Const) else ir.ToFloat(Type.FLOAT, e)
        return e

    def any(self, x: sympy.Basic) -> ir.Expr:
        if x.is_Integer:
            return ir.Const(Type.INT, int(x))
        if x.is_Number or (x.is_number and x.is_extended_real):  # 2.5, oo, and log(2) from exp2 and log2
            return ir.Const(Type.FLOAT, float(x))
        if x == INFINITY:
            return ir.Const(Type.FLOAT, math.inf)
        if x.is_Symbol:
            kind = self.kinds[x.name]
            return ir.Var(Type.FLOAT if x.name == "score" or x.is_integer is not True else Type.INT, x.name, kind)
        if is_tensor_load(x):
            return ir.Load(
                Type.INT if x.is_integer else Type.FLOAT, x.func.__name__, tuple(self.any(a) for a in x.args)
            )
        if isinstance(x, sympy.Add):
            terms = sorted(x.args, key=lambda t: (t.could_extract_minus_sign(), t.is_Number, sympy.default_sort_key(t)))
            out = self.any(terms[0])
            for t in terms[1:]:
                neg = t.could_extract_minus_sign()
                out = self._arith("-" if neg else "+", out, self.any(-t if neg else t))
            return out
        if isinstance(x, sympy.Mul):
            num, den = sympy.fraction(x)
            if den != 1:
                return ir.Arith(Type.FLOAT, "/", self.float(num), self.float(den))
            if x.could_extract_minus_sign():
                inner = self.any(-x)
                return ir.Neg(inner.type, inner)
            return reduce(lambda a, b: self._arith("*", a, b), (self.any(a) for a in x.as_ordered_factors()))
        if isinstance(x, sympy.Pow):
            return self._power(x.base, x.exp)
        if isinstance(x, (sympy.exp, sympy.log, sympy.tanh, sympy.sin, sympy.cos, sympy.tan)):
            return ir.Func(Type.FLOAT, type(x).__name__, (self.float(x.args[0]),))
        if isinstance(x, sympy.Abs):
            inner = self.any(x.args[0])
            return ir.Func(inner.type, "abs", (inner,))
        if isinstance(x, (sympy.Max, sympy.Min)):
            name = "max" if isinstance(x, sympy.Max) else "min"
            return reduce(lambda a, b: self._func2(name, a, b), (self.any(a) for a in x.args))
        if isinstance(x, sympy.sign):
            inner = self.float(x.args[0])
            zero, one = ir.Const(Type.FLOAT, 0.0), ir.Const(Type.FLOAT, 1.0)
            negative = ir.Where(Type.FLOAT, ir.Compare(Type.BOOL, "<", inner, zero), ir.Neg(Type.FLOAT, one), zero)
            return ir.Where(Type.FLOAT, ir.Compare(Type.BOOL, ">", inner, zero), one, negative)
        if isinstance(x, sympy.Heaviside):
            inner = self.float(x.args[0])
            zero = ir.Const(Type.FLOAT, 0.0)
            tie = ir.Where(Type.FLOAT, ir.Compare(Type.BOOL, "<", inner, zero), zero, ir.Const(Type.FLOAT, 0.5))
            return ir.Where(Type.FLOAT, ir.Compare(Type.BOOL, ">", inner, zero), ir.Const(Type.FLOAT, 1.0), tie)
        if isinstance(x, sympy.Piecewise):
            (value, cond), *rest = x.args
            if cond is sympy.true or not rest:
                return self.float(value)
            return ir.Where(Type.FLOAT, self.bool(cond), self.float(value), self.float(sympy.Piecewise(*rest)))
        if isinstance(x, sympy.Mod):
            return ir.Arith(Type.INT, "%", self.any(x.args[0]), self.any(x.args[1]))
        if isinstance(x, sympy.floor):
            num, den = sympy.fraction(x.args[0])
            return ir.Arith(Type.INT, "//", self.any(num), self.any(den))
        raise DerivativeError(f"cannot emit the derivative term {x} of the score expression")

    def bool(self, c: sympy.Basic) -> ir.Expr:
        if c is sympy.true or c is sympy.false:
            return ir.Const(Type.BOOL, bool(c))
        if isinstance(c, sympy.Not):
            return ir.Not(Type.BOOL, self.bool(c.args[0]))
        if isinstance(c, (sympy.And, sympy.Or)):
            op = "and" if isinstance(c, sympy.And) else "or"
            return reduce(lambda a, b: ir.Logic(Type.BOOL, op, a, b), (self.bool(a) for a in c.args))
        ops = {sympy.Ge: ">=", sympy.Gt: ">", sympy.Le: "<=", sympy.Lt: "<", sympy.Eq: "==", sympy.Ne: "!="}
        if type(c) not in ops:
            raise DerivativeError(f"cannot emit the condition {c} in the score expression's derivative")
        lhs, rhs = self.any(c.lhs), self.any(c.rhs)
        if lhs.type is not rhs.type:
            lhs, rhs = self.float(c.lhs), self.float(c.rhs)
        return ir.Compare(Type.BOOL, ops[type(c)], lhs, rhs)

    def _arith(self, op: str, a: ir.Expr, b: ir.Expr) -> ir.Expr:
        if a.type is Type.INT and b.type is Type.INT:
            return ir.Arith(Type.INT, op, a, b)
        return ir.Arith(Type.FLOAT, op, self._as_float(a), self._as_float(b))

    def _func2(self, name: str, a: ir.Expr, b: ir.Expr) -> ir.Expr:
        if a.type is Type.INT and b.type is Type.INT:
            return ir.Func(Type.INT, name, (a, b))
        return ir.Func(Type.FLOAT, name, (self._as_float(a), self._as_float(b)))

    @staticmethod
    def _as_float(e: ir.Expr) -> ir.Expr:
        if e.type is Type.FLOAT:
            return e
        return ir.Const(Type.FLOAT, float(e.value)) if isinstance(e, ir.Const) else ir.ToFloat(Type.FLOAT, e)

    def _power(self, base: sympy.Basic, exponent: sympy.Basic) -> ir.Expr:
        if base == 2 and not exponent.is_Integer:  # exp2's own derivative: 2**x * log(2)
            return ir.Func(Type.FLOAT, "exp2", (self.float(exponent),))
        if exponent.is_Integer and 1 <= exponent <= 4:
            b = self.any(base)
            return reduce(lambda x, y: self._arith("*", x, y), [b] * int(exponent))
        if exponent.is_Integer and -4 <= exponent <= -1:
            return ir.Arith(Type.FLOAT, "/", ir.Const(Type.FLOAT, 1.0), self._power(base, -exponent))
        if exponent == sympy.Rational(1, 2):
            return ir.Func(Type.FLOAT, "sqrt", (self.float(base),))
        if exponent == sympy.Rational(-1, 2):
            return ir.Arith(
                Type.FLOAT, "/", ir.Const(Type.FLOAT, 1.0), ir.Func(Type.FLOAT, "sqrt", (self.float(base),))
            )
        # b ** e = exp(e * log(b)) for b > 0, the only case a real-valued score expression reaches.
        log_b = ir.Func(Type.FLOAT, "log", (self.float(base),))
        return ir.Func(Type.FLOAT, "exp", (ir.Arith(Type.FLOAT, "*", self.float(exponent), log_b),))
