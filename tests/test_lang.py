"""The expression language: parsing, type checking, and printing back from the IR."""

import pytest
from hypothesis import given, settings

from attngen import ir
from attngen.ir import Type
from attngen.lang.parser import MAX_DEPTH, ParseError, parse
from attngen.lang.typecheck import MAX_MASK_COMPARISONS, MAX_MIN_MAX, Scope, typecheck
from attngen.plan import spec_text
from tests import harness
from tests.strategies import FLOAT_PARAM, INT_PARAM, masks, score_exprs, spec_toml

SCOPE = Scope({INT_PARAM: Type.INT, FLOAT_PARAM: Type.FLOAT}, allow_score=True)


def typed(text: str, want=Type.BOOL, scope=SCOPE):
    expr, problems = typecheck(parse(text), scope, want)
    assert not problems, problems
    return expr


def test_precedence():
    e = typed("q_idx >= kv_idx or kv_idx < 3 and not h == 1")
    assert isinstance(e, ir.Logic) and e.op == "or"
    assert isinstance(e.rhs, ir.Logic) and e.rhs.op == "and"
    assert isinstance(e.rhs.rhs, ir.Not) and isinstance(e.rhs.rhs.operand, ir.Compare)
    e = typed("-q_idx * 2 + kv_idx // 3 % 4 == 0")
    lhs = e.lhs
    assert lhs.op == "+" and lhs.lhs.op == "*" and isinstance(lhs.lhs.lhs, ir.Neg)
    assert lhs.rhs.op == "%" and lhs.rhs.lhs.op == "//"


def test_promotion_is_explicit():
    e = typed("score + q_idx", want=Type.FLOAT)
    assert isinstance(e.rhs, ir.ToFloat)
    e = typed("q_idx / 2 > 1", want=Type.BOOL)
    assert e.lhs.type is Type.FLOAT and e.lhs.rhs == ir.Const(Type.FLOAT, 2.0)


@pytest.mark.parametrize(
    "text, offset",
    [("q_idx >= ", 9), ("a < b < c", 6), ("q_idx $ 1", 6), ("f(,)", 2), ("", 0), ("q_idx ≥ kv_idx", 6)],
)
def test_parse_errors_point_at_the_problem(text, offset):
    with pytest.raises(ParseError) as e:
        parse(text)
    assert e.value.offset == offset


def test_depth_and_length_limits():
    with pytest.raises(ParseError, match="longer"):
        parse("q_idx + " * 1000 + "1 > 0")
    # Parentheses are not nesting: the AST of 2000 of them is one name (and no RecursionError).
    assert parse("(" * 2000 + "q_idx" + ")" * 2000).name == "q_idx"
    parse("q_idx" + " + 1" * (MAX_DEPTH - 1) + " > 0")  # a chain of MAX_DEPTH operands
    for too_deep in ("q_idx" + " + 1" * MAX_DEPTH + " > 0", "-" * (MAX_DEPTH + 1) + "q_idx", "not " * 70 + "b > 0"):
        with pytest.raises(ParseError, match="nested more than"):
            parse(too_deep)


def test_non_ascii_names_its_code_point():
    """A look-alike letter from another script is named, so the user sees why `q_іdx` fails."""
    with pytest.raises(ParseError, match=r"'і' \(U\+0456\)") as e:
        parse("q_іdx > 1")
    assert e.value.offset == 2


@pytest.mark.parametrize(
    "text, want, message, culprit",
    [
        ("score * 1e999", Type.FLOAT, "does not fit in float32", "1e999"),
        ("score * 3.5e38", Type.FLOAT, "does not fit in float32", "3.5e38"),
        ("score + 1e-999", Type.FLOAT, "smaller than float32 keeps", "1e-999"),
        ("score + 1e-40", Type.FLOAT, "smaller than float32 keeps", "1e-40"),
        ("q_idx > 2147483648", Type.BOOL, "does not fit in int32", "2147483648"),
        ("q_idx > " + "9" * 400, Type.BOOL, "does not fit in int32", "9" * 400),
        ("q_idx * (2147483647 + 1) > 0", Type.BOOL, "constant does not fit in int32", "2147483647 + 1"),
        ("score * (1e20 * 1e20)", Type.FLOAT, "constant does not fit in float32", "1e20 * 1e20"),
        ("score * exp(100.0)", Type.FLOAT, "does not fit in float32", "exp(100.0)"),
        ("score * exp(1000.0)", Type.FLOAT, "exp of this constant overflows float32", "exp(1000.0)"),
        ("q_idx // 0 == 1", Type.BOOL, "division by zero", "0"),
        ("q_idx % (2 - 2) == 1", Type.BOOL, "division by zero", "2 - 2"),
        ("score / 0.0", Type.FLOAT, "division by zero", "0.0"),
        ("score * (0.0 / 0.0)", Type.FLOAT, "division by zero", "0.0"),
        ("score + log(0.0)", Type.FLOAT, "log of a number that is never positive", "log(0.0)"),
        ("score + sqrt(-1.0)", Type.FLOAT, "sqrt of a number that is always negative", "sqrt(-1.0)"),
        # Not constant, but sympy (which the analyses use) finds no finite real value.
        ("q_idx % (kv_idx - kv_idx) == 0", Type.BOOL, "divisor is always 0", "q_idx % (kv_idx - kv_idx)"),
        ("q_idx // (h % 1) == 0", Type.BOOL, "divisor is always 0", "q_idx // (h % 1)"),
        ("score / (h - h)", Type.FLOAT, "divisor is always 0", "score / (h - h)"),
        ("log(q_idx - q_idx) < 1.0", Type.BOOL, "log of a number that is never positive", "log(q_idx - q_idx)"),
        ("sqrt(-q_idx - 1.0) < 2", Type.BOOL, "sqrt of a number that is always negative", "sqrt(-q_idx - 1.0)"),
    ],
)
def test_values_the_kernels_cannot_compute_are_errors(text, want, message, culprit):
    """Overflowing literals and constants, division by zero and log/sqrt outside their domain
    are errors at the sub-expression, never inf, NaN or an exception inside sympy."""
    expr, problems = typecheck(parse(text), SCOPE, want)
    assert expr is None
    (problem,) = problems
    assert message in problem.message and text[problem.span.start : problem.span.end] == culprit


@pytest.mark.parametrize(
    "text",
    ["score * 3.4e38", "score + 1.2e-38", "score * 0.0", "q_idx > 2147483647", "q_idx % 1 == 0", "score + log(1.0)"],
)
def test_values_at_the_edge_are_accepted(text):
    typed(text, want=Type.FLOAT if text.startswith("score") else Type.BOOL)


def test_compile_time_budgets():
    """What the tile analysis and the derivative would take minutes over is refused up front."""
    atoms = [f"q_idx - kv_idx < {i}" for i in range(MAX_MASK_COMPARISONS + 1)]
    typed(" or ".join(atoms[:-1]))
    _, problems = typecheck(parse(" or ".join(atoms)), SCOPE, Type.BOOL)
    (problem,) = problems
    assert f"too complex for the tile analysis: {MAX_MASK_COMPARISONS + 1} comparisons" in problem.message
    nested = "q_idx > 0"  # a bool == repeats both operands in negation normal form: 4, 10, 22, 46, 94
    for i in range(5):
        nested = f"({nested}) == (kv_idx > {i})"
    _, problems = typecheck(parse(nested), SCOPE, Type.BOOL)
    assert "94 comparisons" in problems[0].message
    calls = "score"
    for i in range(MAX_MIN_MAX + 1):
        calls = f"max({calls}, score * {i}.5)"
    _, problems = typecheck(parse(calls), SCOPE, Type.FLOAT)
    assert f"{MAX_MIN_MAX + 1} calls of min and max" in problems[0].message


@pytest.mark.parametrize(
    "text, want, scope, message",
    [
        ("score > 0", Type.BOOL, Scope({}, allow_score=False), "cannot read `score`"),
        ("q_idx + 1", Type.BOOL, SCOPE, "must be bool"),
        ("q_idx > 1", Type.FLOAT, SCOPE, "must be float"),
        ("score // 2.0 > 1", Type.BOOL, SCOPE, "needs int operands"),
        ("frob(q_idx) > 1", Type.BOOL, SCOPE, "unknown function"),
        ("tanh(1, 2) > 1", Type.BOOL, SCOPE, "takes 1 argument"),
        ("where(q_idx, 1, 2) > 1", Type.BOOL, SCOPE, "condition needs a bool"),
        ("(q_idx > 1) + 1 > 0", Type.BOOL, SCOPE, "numeric operands"),
        ("window > 1", Type.BOOL, SCOPE, "unknown name `window`"),
        ("q_idx > 99999999999", Type.BOOL, SCOPE, "int32"),
    ],
)
def test_type_errors(text, want, scope, message):
    expr, problems = typecheck(parse(text), scope, want)
    assert expr is None
    assert any(message in p.message for p in problems), problems


def test_all_problems_are_reported():
    _, problems = typecheck(parse("foo > 1 and bar < 2"), SCOPE, Type.BOOL)
    assert [p.span.start for p in problems] == [0, 12]


@settings(max_examples=200)
@given(mask=masks(max_depth=3), score=score_exprs())
def test_ir_prints_back_to_the_same_ir(mask, score):
    """Printing the IR in the spec language and parsing it again gives the same IR: the printer
    is faithful, precedence included."""
    spec = harness.spec_from_text(spec_toml(mask, score))
    for which, expr, want in (("mask", spec.mask, Type.BOOL), ("score", spec.score, Type.FLOAT)):
        again = typed(spec_text(spec, which), want=want)
        assert again == expr
