"""Stage: AST -> typed IR.

Goals: resolve every name (index variables, `score`, declared params), check operand types,
make int -> float promotions explicit, and report every problem with its span. Reject what has
no value in the kernels' arithmetic: a constant (sub)expression is evaluated, and must fit in
int32 or float32 and not divide by zero or leave the domain of log and sqrt; a divisor that is
always 0, or a log of a number that is never positive, is found through sympy, the algebra the
tile analysis and the derivative use, so no later stage meets a non-finite or complex value.
Bound the work of those stages, which grows faster than the expression: a mask may hold at most
MAX_MASK_COMPARISONS comparisons once in negation normal form (what the tile analysis walks), a
score expression at most MAX_MIN_MAX calls of min and max (each doubles its derivative's cases).
The literal inf (and -inf, its negation) is a value to choose or compare, as a score modifier
returns -inf to drop a key: arithmetic with an infinite constant and a value that varies is an
error (its result is infinite or NaN whatever that value is), and a constant that folds to NaN
(inf - inf) is one too.
Non-goals: no simplification or constant folding (constants are evaluated to be checked, not
replaced); the IR mirrors what the user wrote.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import sympy

from attngen import ir
from attngen.ir import Type
from attngen.ir_sympy import to_sympy
from attngen.lang import parser as ast

_NUMERIC = (Type.INT, Type.FLOAT)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32; GPUs flush smaller values to 0
# Compile-time budgets (see the module docstring): measured, a mask at the limit analyses in
# about 20 s and a score expression in about 5 s; real masks and scores stay far below.
MAX_MASK_COMPARISONS = 32
MAX_MIN_MAX = 16


_INDEX_EXAMPLES = {1: "h", 2: "b, q_idx", 3: "b, h, q_idx", 4: "b, h, q_idx, kv_idx"}


@dataclass(frozen=True)
class TypeProblem:
    message: str
    span: ast.Span
    hint: str | None = None


@dataclass
class Scope:
    """What names an expression may read: scalar params map to their type, tensor params to
    (element type, rank)."""

    params: dict[str, Type]
    allow_score: bool
    tensors: dict[str, tuple[Type, int]] = field(default_factory=dict)


@dataclass
class _Checker:
    scope: Scope
    problems: list[TypeProblem] = field(default_factory=list)
    # id(IR node) -> (node, value) for each constant node; the node is kept so its id stays unique.
    constants: dict[int, tuple[ir.Expr, int | float | bool]] = field(default_factory=dict)
    spans: dict[int, tuple[ir.Expr, ast.Span]] = field(default_factory=dict)  # id(IR node) -> its source

    def error(self, message: str, node: ast.Node, hint: str | None = None) -> None:
        self.problems.append(TypeProblem(message, node.span, hint))

    def check(self, node: ast.Node) -> ir.Expr | None:
        """Typed IR for node, or None after recording a problem."""
        expr = self._typed(node)
        if expr is None or not self._fold(expr, node):
            return None
        self.spans[id(expr)] = (expr, node.span)
        return expr

    def value(self, e: ir.Expr) -> int | float | bool | None:
        """The value of e if it is a constant, else None."""
        if isinstance(e, ir.Const):
            return e.value
        if isinstance(e, ir.ToFloat):
            inner = self.value(e.operand)
            return None if inner is None else float(inner)
        entry = self.constants.get(id(e))
        return entry[1] if entry is not None and entry[0] is e else None

    def _fold(self, expr: ir.Expr, node: ast.Node) -> bool:
        """Evaluate expr if it is constant and check the value fits the kernels' types; False
        after recording a problem."""
        if isinstance(expr, (ir.Var, ir.Load)):  # runtime values
            return True
        if isinstance(expr, ir.Const):
            value = expr.value
        else:
            operands = [self.value(c) for c in ir.children(expr)]
            if None in operands:
                return self._finite_arithmetic(expr, operands, node)
            try:
                value = _evaluate(expr, operands)
            except (ArithmeticError, ValueError):
                self.error(_no_value_message(expr), node)
                return False
        problem = _range_problem(value, node.text if isinstance(node, ast.Num) else None)
        if problem:
            self.error(problem, node)
            return False
        self.constants[id(expr)] = (expr, value)
        return True

    def _finite_arithmetic(self, expr: ir.Expr, operands: list, node: ast.Node) -> bool:
        """False after recording a problem if expr does arithmetic with an infinite constant and a
        value that varies (choosing it with where, min or max, or comparing with it, is fine)."""
        if isinstance(expr, ir.Arith) and any(isinstance(v, float) and math.isinf(v) for v in operands):
            self.error(
                "arithmetic with an infinity: the result is infinite or NaN whatever the other operand",
                node,
                "choose it instead, e.g. where(kv_idx > q_idx, -inf, score) or min(score, inf)",
            )
            return False
        return True

    def _typed(self, node: ast.Node) -> ir.Expr | None:
        if isinstance(node, ast.Num):
            return ir.Const(Type.INT if isinstance(node.value, int) else Type.FLOAT, node.value)
        if isinstance(node, ast.Name):
            return self._name(node)
        if isinstance(node, ast.Unary):
            operand = self.check(node.operand)
            if operand is None:
                return None
            if node.op == "not":
                if operand.type is not Type.BOOL:
                    return self._mismatch("not", "a bool", operand, node)
                return ir.Not(Type.BOOL, operand)
            if operand.type not in _NUMERIC:
                return self._mismatch("unary -", "a number", operand, node)
            return ir.Neg(operand.type, operand)
        if isinstance(node, ast.Binary):
            return self._binary(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, ast.Index):
            return self._index(node)
        raise AssertionError(f"unhandled AST node {node!r}")

    def _name(self, node: ast.Name) -> ir.Expr | None:
        if node.name in ir.INDEX_VARS:
            return ir.Var(Type.INT, node.name, ir.VarKind.INDEX)
        if node.name in ir.SIZE_VARS:
            return ir.Var(Type.INT, node.name, ir.VarKind.SIZE)
        if node.name == "score":
            if not self.scope.allow_score:
                self.error("a mask cannot read `score`", node, "masks depend on positions and params only")
                return None
            return ir.Var(Type.FLOAT, "score", ir.VarKind.SCORE)
        if node.name in self.scope.params:
            return ir.Var(self.scope.params[node.name], node.name, ir.VarKind.PARAM)
        if node.name in self.scope.tensors:
            example = _INDEX_EXAMPLES[self.scope.tensors[node.name][1]]
            self.error(f"`{node.name}` is a tensor: read one element", node, f"e.g. {node.name}[{example}]")
            return None
        known = [*ir.INDEX_VARS, *ir.SIZE_VARS, *(["score"] if self.scope.allow_score else []), *self.scope.params]
        known += self.scope.tensors
        self.error(
            f"unknown name `{node.name}`", node, f"known names: {', '.join(known)}; declare runtime values in [params]"
        )
        return None

    def _mismatch(self, what: str, wanted: str, got: ir.Expr, node: ast.Node) -> None:
        self.error(f"{what} needs {wanted}, got {got.type.value}", node)

    def _binary(self, node: ast.Binary) -> ir.Expr | None:
        lhs, rhs = self.check(node.lhs), self.check(node.rhs)
        if lhs is None or rhs is None:
            return None
        op = node.op
        if op in ("and", "or"):
            for side in (lhs, rhs):
                if side.type is not Type.BOOL:
                    return self._mismatch(f"`{op}`", "bool operands", side, node)
            return ir.Logic(Type.BOOL, op, lhs, rhs)
        if op in ("==", "!=") and lhs.type is Type.BOOL and rhs.type is Type.BOOL:
            return ir.Compare(Type.BOOL, op, lhs, rhs)
        for side in (lhs, rhs):
            if side.type not in _NUMERIC:
                return self._mismatch(f"`{op}`", "numeric operands", side, node)
        if op in ("/", "//", "%") and self.value(rhs) == 0:
            self.error("division by zero: the divisor is 0", node.rhs)
            return None
        if op in ("//", "%"):
            if lhs.type is not Type.INT or rhs.type is not Type.INT:
                self.error(f"`{op}` needs int operands", node, "use / for float division")
                return None
            return ir.Arith(Type.INT, op, lhs, rhs)
        if op == "/":
            return ir.Arith(Type.FLOAT, op, _to_float(lhs), _to_float(rhs))
        lhs, rhs, common = _promote(lhs, rhs)
        if op in ("+", "-", "*"):
            return ir.Arith(common, op, lhs, rhs)
        return ir.Compare(Type.BOOL, op, lhs, rhs)

    def _index(self, node: ast.Index) -> ir.Expr | None:
        if node.name not in self.scope.tensors:
            what = "a scalar param" if node.name in self.scope.params else "not a tensor param"
            self.error(
                f"`{node.name}` is {what}: it cannot be indexed", node, 'declare e.g. t = "float[heads]" in [params]'
            )
            return None
        elem, rank = self.scope.tensors[node.name]
        if len(node.args) != rank:
            self.error(f"`{node.name}` has {rank} axes, indexed with {len(node.args)}", node)
            return None
        indices = [self.check(a) for a in node.args]
        if None in indices:
            return None
        for index, a_node in zip(indices, node.args):
            if index.type is not Type.INT:
                return self._mismatch("an index", "an int", index, a_node)
        return ir.Load(elem, node.name, tuple(indices))

    def _call(self, node: ast.Call) -> ir.Expr | None:
        args = [self.check(a) for a in node.args]
        if node.func == "where":
            if len(args) != 3:
                self.error(f"where(cond, a, b) takes 3 arguments, got {len(args)}", node)
                return None
            if None in args:
                return None
            cond, a, b = args
            if cond.type is not Type.BOOL:
                return self._mismatch("where's condition", "a bool", cond, node.args[0])
            if a.type is Type.BOOL and b.type is Type.BOOL:
                return ir.Where(Type.BOOL, cond, a, b)
            for side in (a, b):
                if side.type not in _NUMERIC:
                    return self._mismatch("where's branches", "numbers (or both bools)", side, node)
            a, b, common = _promote(a, b)
            return ir.Where(common, cond, a, b)
        if node.func not in ir.FUNCTIONS:
            self.error(f"unknown function `{node.func}`", node, f"functions: where, {', '.join(ir.FUNCTIONS)}")
            return None
        arity, rule = ir.FUNCTIONS[node.func]
        if len(args) != arity:
            self.error(f"{node.func} takes {arity} argument{'s' * (arity > 1)}, got {len(args)}", node)
            return None
        if None in args:
            return None
        for a, a_node in zip(args, node.args):
            if a.type not in _NUMERIC:
                return self._mismatch(node.func, "numeric arguments", a, a_node)
        if rule == "float":
            return ir.Func(Type.FLOAT, node.func, tuple(_to_float(a) for a in args))
        if arity == 2:
            lhs, rhs, common = _promote(*args)
            return ir.Func(common, node.func, (lhs, rhs))
        return ir.Func(args[0].type, node.func, tuple(args))


def _to_float(e: ir.Expr) -> ir.Expr:
    if e.type is Type.FLOAT:
        return e
    if isinstance(e, ir.Const):
        return ir.Const(Type.FLOAT, float(e.value))
    return ir.ToFloat(Type.FLOAT, e)


def _promote(a: ir.Expr, b: ir.Expr) -> tuple[ir.Expr, ir.Expr, Type]:
    if a.type is Type.INT and b.type is Type.INT:
        return a, b, Type.INT
    return _to_float(a), _to_float(b), Type.FLOAT


def _evaluate(e: ir.Expr, operands: list) -> int | float | bool:
    """Value of e from its operands' values, as the kernels compute it (floor // and %)."""
    if isinstance(e, ir.Neg):
        return -operands[0]
    if isinstance(e, ir.Not):
        return not operands[0]
    if isinstance(e, ir.Arith):
        ops = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}
        ops |= {"//": operator.floordiv, "%": operator.mod}
        return ops[e.op](*operands)
    if isinstance(e, ir.Compare):
        ops = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt}
        return (ops | {">=": operator.ge})[e.op](*operands)
    if isinstance(e, ir.Logic):
        return operands[0] and operands[1] if e.op == "and" else operands[0] or operands[1]
    if isinstance(e, ir.Where):
        return operands[1] if operands[0] else operands[2]
    if isinstance(e, ir.Func):
        functions = {"exp": math.exp, "log": math.log, "sqrt": math.sqrt, "tanh": math.tanh, "sin": math.sin}
        functions |= {"cos": math.cos, "tan": math.tan, "exp2": lambda x: 2.0**x, "log2": math.log2}
        return (functions | {"abs": abs, "min": min, "max": max})[e.name](*operands)
    raise AssertionError(f"unhandled IR node {e!r}")


def _no_value_message(e: ir.Expr) -> str:
    """Why e (whose evaluation failed, or which sympy finds no finite real form for) has no value."""
    if isinstance(e, ir.Arith) and e.op in ("/", "//", "%"):
        return "division by zero: the divisor is always 0"
    if isinstance(e, ir.Func) and e.name in ("log", "log2"):
        return f"{e.name} of a number that is never positive"
    if isinstance(e, ir.Func) and e.name == "sqrt":
        return "sqrt of a number that is always negative"
    if isinstance(e, ir.Func) and e.name in ("exp", "exp2"):
        return f"{e.name} of this constant overflows float32"
    if isinstance(e, ir.Func) and e.name in ("sin", "cos", "tan"):
        return f"{e.name} of an infinity has no value"
    return "this has no finite real value"


def _range_problem(value: float | bool, literal: str | None) -> str | None:
    """Why a constant cannot be a kernel value, or None; `literal` is its text if it is one."""
    what = f"literal {literal}" if literal is not None else "constant"
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return None if INT32_MIN <= value <= INT32_MAX else f"integer {what} does not fit in int32"
    if math.isnan(value):
        return f"this {what} is NaN (not a number): inf - inf, 0 * inf and inf / inf have no value"
    # An infinite constant comes from the literal inf (a finite computation leaves float32's range,
    # and is refused, before it reaches float64's); a longer literal such as 1e999 is an overflow.
    if math.isinf(value) and literal in (None, "inf"):
        return None
    if not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        return f"float {what} does not fit in float32 (largest: 3.4e38)"
    # Only a literal: a literal that rounds to 0 is a typo, a computed product may underflow.
    written_nonzero = literal is not None and any(c in "123456789" for c in literal.lower().split("e")[0])
    if written_nonzero and abs(value) < FLOAT32_TINY:
        return f"float {what} is smaller than float32 keeps (smallest: 1.2e-38); write 0.0 for zero"
    return None


def _sympy_symbols(scope: Scope) -> dict[str, sympy.Symbol]:
    """The symbols the derivative pass uses; the tile analysis assumes less about q_idx, kv_idx."""
    real = {Type.INT: {"integer": True}, Type.FLOAT: {"real": True}}
    return {
        **{n: sympy.Symbol(n, integer=True, nonnegative=True) for n in ir.INDEX_VARS},
        **{n: sympy.Symbol(n, integer=True, positive=True) for n in ir.SIZE_VARS},
        "score": sympy.Symbol("score", real=True),
        **{n: sympy.Symbol(n, **real[t]) for n, t in scope.params.items()},
    }


def _degenerate(e: ir.Expr, symbols: dict[str, sympy.Symbol]) -> bool:
    """Whether sympy finds no finite real form for e (a division by an expression that is always
    0, the log of one that is never positive, ...): the later stages would fail on it."""
    try:
        form = to_sympy(e, symbols)
    except (ArithmeticError, TypeError, ValueError):  # e.g. comparing a complex number
        return True
    if form.has(sympy.zoo, sympy.nan, sympy.oo, -sympy.oo, sympy.I):
        return True
    return e.type is not Type.BOOL and form.is_extended_real is False


def _degenerate_problem(checker: _Checker, expr: ir.Expr) -> TypeProblem | None:
    """The innermost sub-expression of expr with no finite real form, as a problem; None if there
    is none."""
    symbols = _sympy_symbols(checker.scope)
    if not _degenerate(expr, symbols):
        return None
    span = checker.spans[id(expr)][1]
    while bad := next((c for c in ir.children(expr) if _degenerate(c, symbols)), None):
        expr = bad
        entry = checker.spans.get(id(expr))
        span = entry[1] if entry is not None and entry[0] is expr else span  # promotions have no span
    return TypeProblem(_no_value_message(expr), span)


def _nnf_comparisons(e: ir.Expr) -> tuple[int, int]:
    """Comparisons in the negation normal form of bool e and of `not e`, as sympy writes them:
    a bool == or where repeats its operands."""
    if isinstance(e, ir.Not):
        positive, negative = _nnf_comparisons(e.operand)
        return negative, positive
    if isinstance(e, ir.Logic):
        (a, not_a), (b, not_b) = _nnf_comparisons(e.lhs), _nnf_comparisons(e.rhs)
        return a + b, not_a + not_b
    if isinstance(e, ir.Compare) and e.lhs.type is Type.BOOL:  # (a & b) | (~a & ~b), and its Xor
        both = sum(_nnf_comparisons(e.lhs)) + sum(_nnf_comparisons(e.rhs))
        return both, both
    if isinstance(e, ir.Where) and e.type is Type.BOOL:  # (c & a) | (~c & b)
        (c, not_c), (a, not_a), (b, not_b) = (_nnf_comparisons(x) for x in (e.cond, e.if_true, e.if_false))
        return c + not_c + a + b, c + not_c + not_a + not_b
    return 1, 1  # a comparison of numbers, or a constant


def _calls(e: ir.Expr, names: tuple[str, ...]) -> int:
    own = isinstance(e, ir.Func) and e.name in names
    return own + sum(_calls(c, names) for c in ir.children(e))


def _budget_problem(expr: ir.Expr, node: ast.Node, want: Type) -> TypeProblem | None:
    """Why expr would cost the later stages too much, or None."""
    if want is Type.BOOL and (n := _nnf_comparisons(expr)[0]) > MAX_MASK_COMPARISONS:
        return TypeProblem(
            f"this mask is too complex for the tile analysis: {n} comparisons in negation normal form"
            f" (at most {MAX_MASK_COMPARISONS})",
            node.span,
            "simplify it; a bool == and a where of bools count their operands twice",
        )
    if want is Type.FLOAT and (n := _calls(expr, ("min", "max"))) > MAX_MIN_MAX:
        return TypeProblem(
            f"this score expression has {n} calls of min and max (at most {MAX_MIN_MAX}):"
            " its derivative would be too large",
            node.span,
        )
    return None


def typecheck(node: ast.Node, scope: Scope, want: Type) -> tuple[ir.Expr | None, list[TypeProblem]]:
    """Typed IR of node (None if there were problems) and the problems found."""
    checker = _Checker(scope)
    expr = checker.check(node)
    if expr is not None and expr.type is not want:
        what = "a mask" if want is Type.BOOL else "a score expression"
        hint = "compare positions, e.g. q_idx >= kv_idx" if want is Type.BOOL else "use `score`, e.g. score + 1.0"
        checker.error(f"{what} must be {want.value}, this is {expr.type.value}", node, hint)
        expr = None
    if expr is not None and not checker.problems:
        problem = _budget_problem(expr, node, want) or _degenerate_problem(checker, expr)
        checker.problems += [problem] if problem else []
    return (expr if not checker.problems else None), checker.problems
