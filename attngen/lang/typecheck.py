"""Stage: AST -> typed IR.

Goals: resolve every name (index variables, `score`, declared params), check operand types,
make int -> float promotions explicit, and report every problem with its span.
Non-goals: no simplification or constant folding; the IR mirrors what the user wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attngen import ir
from attngen.ir import Type
from attngen.lang import parser as ast

_NUMERIC = (Type.INT, Type.FLOAT)


@dataclass(frozen=True)
class TypeProblem:
    message: str
    span: ast.Span
    hint: str | None = None


@dataclass
class Scope:
    """What names an expression may read: params map to their declared type."""

    params: dict[str, Type]
    allow_score: bool


@dataclass
class _Checker:
    scope: Scope
    problems: list[TypeProblem] = field(default_factory=list)

    def error(self, message: str, node: ast.Node, hint: str | None = None) -> None:
        self.problems.append(TypeProblem(message, node.span, hint))

    def check(self, node: ast.Node) -> ir.Expr | None:
        """Typed IR for node, or None after recording a problem."""
        if isinstance(node, ast.Num):
            kind = Type.INT if isinstance(node.value, int) else Type.FLOAT
            if kind is Type.INT and abs(node.value) >= 2**31:
                self.error("integer literal does not fit in int32", node)
                return None
            return ir.Const(kind, node.value)
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
        raise AssertionError(f"unhandled AST node {node!r}")

    def _name(self, node: ast.Name) -> ir.Expr | None:
        if node.name in ir.INDEX_VARS:
            return ir.Var(Type.INT, node.name, ir.VarKind.INDEX)
        if node.name == "score":
            if not self.scope.allow_score:
                self.error("a mask cannot read `score`", node, "masks depend on positions and params only")
                return None
            return ir.Var(Type.FLOAT, "score", ir.VarKind.SCORE)
        if node.name in self.scope.params:
            return ir.Var(self.scope.params[node.name], node.name, ir.VarKind.PARAM)
        known = [*ir.INDEX_VARS, *(["score"] if self.scope.allow_score else []), *self.scope.params]
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


def typecheck(node: ast.Node, scope: Scope, want: Type) -> tuple[ir.Expr | None, list[TypeProblem]]:
    """Typed IR of node (None if there were problems) and the problems found."""
    checker = _Checker(scope)
    expr = checker.check(node)
    if expr is not None and expr.type is not want:
        what = "a mask" if want is Type.BOOL else "a score expression"
        hint = "compare positions, e.g. q_idx >= kv_idx" if want is Type.BOOL else "use `score`, e.g. score + 1.0"
        checker.error(f"{what} must be {want.value}, this is {expr.type.value}", node, hint)
        expr = None
    return (expr if not checker.problems else None), checker.problems
