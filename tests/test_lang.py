"""The expression language: parsing, type checking, and printing back from the IR."""

import pytest
from hypothesis import given, settings

from attngen import ir
from attngen.ir import Type
from attngen.lang.parser import ParseError, parse
from attngen.lang.typecheck import Scope, typecheck
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
    with pytest.raises(ParseError, match="nested"):
        parse("(" * 100 + "q_idx" + ")" * 100 + " > 1")
    with pytest.raises(ParseError, match="longer"):
        parse("q_idx + " * 1000 + "1 > 0")


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
