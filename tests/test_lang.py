"""The expression language: parsing, type checking, and printing back from the IR."""

import numpy as np
import pytest
from hypothesis import given, settings

from attngen import SpecError, ir, parse_spec
from attngen.analysis import analyse_mask
from attngen.analysis.derivative import score_derivative
from attngen.ir import Type
from attngen.lang.parser import MAX_DEPTH, ParseError, parse
from attngen.lang.typecheck import MAX_MASK_COMPARISONS, MAX_MIN_MAX, Scope, typecheck
from attngen.plan import spec_text
from attngen.reference import evaluate
from attngen.spec import load_spec
from tests import harness
from tests.strategies import FLOAT_PARAM, INT_PARAM, masks, score_exprs, spec_toml
from tests.test_analysis import EMPTY, FULL, brute_force, classify

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


def test_reads_pairs_tells_a_full_bias_from_tables():
    """ir.reads_pairs: a tensor read at each (query, key) pair, not a table read by distance, a
    per-head slope or a per-position id (the Hopper kernels' default depends on it)."""
    scores = {name: load_spec(f"specs/{name}.toml").score for name in ("bias", "relative_bias", "alibi_slopes")}
    assert {name: ir.reads_pairs(e) for name, e in scores.items()} == {
        "bias": True,
        "relative_bias": False,
        "alibi_slopes": False,
    }
    assert not ir.reads_pairs(load_spec("specs/document.toml").mask)  # doc[b, q_idx] == doc[b, kv_idx]


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
        ("score + log2(0.0)", Type.FLOAT, "log2 of a number that is never positive", "log2(0.0)"),
        ("score * exp2(200.0)", Type.FLOAT, "does not fit in float32", "exp2(200.0)"),
        ("score * exp2(2000.0)", Type.FLOAT, "exp2 of this constant overflows float32", "exp2(2000.0)"),
        ("score + sin(inf)", Type.FLOAT, "sin of an infinity has no value", "sin(inf)"),
        # inf is a value to choose or compare: arithmetic with it is inf or NaN whatever score is.
        ("score - inf", Type.FLOAT, "arithmetic with an infinity", "score - inf"),
        ("where(h > 0, score * -inf, score)", Type.FLOAT, "arithmetic with an infinity", "score * -inf"),
        ("score * (inf - inf)", Type.FLOAT, "NaN", "inf - inf"),
        ("score * (0.0 * -inf)", Type.FLOAT, "NaN", "0.0 * -inf"),
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
    [
        *(
            "score * 3.4e38",
            "score + 1.2e-38",
            "score * 0.0",
            "q_idx > 2147483647",
            "q_idx % 1 == 0",
            "score + log(1.0)",
        ),
        *("score + where(score > 2.0, -inf, 1.0)", "score - min(score, inf)", "score + max(score, -inf) + 1.0"),
        "score + exp(-inf)",
        *("score * (1.0 / inf)", "kv_idx < inf", "score + sin(score) * cos(score) + tan(1.5) + exp2(-126.0)"),
    ],
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


@pytest.mark.parametrize(
    "text, offset, width, word",
    [
        ("q_idx >= kv_idx && kv_idx < 3", 16, 2, "and"),
        ("q_idx >= kv_idx & kv_idx < 3", 16, 1, "and"),
        ("q_idx == 0 || q_idx >= kv_idx", 11, 2, "or"),
        ("!(q_idx < kv_idx)", 0, 1, "not"),
    ],
)
def test_c_style_logic_gets_a_located_hint(text, offset, width, word):
    with pytest.raises(ParseError) as e:
        parse(text)
    assert (e.value.offset, e.value.width) == (offset, width)
    assert e.value.hint == f"write `{word}` instead of `{text[offset : offset + width]}`"
    assert parse("not (q_idx != kv_idx)")  # `!=` is still a comparison


def test_c_style_logic_in_a_spec_is_located_with_its_hint():
    with pytest.raises(SpecError) as e:
        parse_spec('name = "x"\nhead_dim = 64\n[mask]\nexpr = "q_idx >= kv_idx && kv_idx > 0"\n', "s.toml")
    (d,) = e.value.diagnostics
    assert (d.location.line, d.location.col, d.width) == (4, 25, 2)
    assert d.hint == "write `and` instead of `&&`"


def test_inf_is_a_keyword_and_line_ends_are_blanks():
    assert typed("-inf", want=Type.FLOAT) == ir.Neg(Type.FLOAT, ir.Const(Type.FLOAT, float("inf")))
    assert parse("info > 1").lhs.name == "info"  # a longer name is a name
    e = typed("where(kv_idx > q_idx,\r\n  -inf,\n  score)", want=Type.FLOAT)
    assert e.if_true == ir.Neg(Type.FLOAT, ir.Const(Type.FLOAT, float("inf")))
    with pytest.raises(ParseError) as error:
        parse("q_idx >=\n  $ kv_idx")
    assert error.value.offset == 11
    with pytest.raises(SpecError, match="`inf` is a name of the expression language"):
        parse_spec('name = "x"\nhead_dim = 64\n[mask]\nexpr = "kv_idx < inf"\n[params]\ninf = "float"\n', "s.toml")


def test_errors_in_a_multi_line_expression_are_located():
    """Line and column of the culprit inside a \"\"\" string; a span over line ends underlines its
    first line only."""
    text = 'name = "x"\nhead_dim = 64\n[mask]\nexpr = """\nq_idx >= kv_idx\n  and frob(kv_idx) > 0\n"""\n'
    with pytest.raises(SpecError) as e:
        parse_spec(text, "s.toml")
    (d,) = e.value.diagnostics
    assert (d.location.line, d.location.col, d.width) == (6, 7, len("frob(kv_idx)"))
    text = 'name = "x"\nhead_dim = 64\n[mask]\nexpr = """\nq_idx >= kv_idx and (q_idx\n  + 1)\n"""\n'
    with pytest.raises(SpecError) as e:
        parse_spec(text, "s.toml")
    (d,) = e.value.diagnostics
    assert (d.location.line, d.location.col, d.width) == (5, 1, len("q_idx >= kv_idx and (q_idx"))


@pytest.mark.parametrize(
    "score",
    [
        "sin(score) * cos(0.5 * score)",
        "tan(0.7 * tanh(score))",
        "exp2(1.5 * score) - log2(score * score + 1.0)",
        "where(score > 1.0, -inf, 2.0 * score)",
        # sympy takes min(x, where(c, -oo, oo)) for the where: inf is a symbol to it, not oo.
        "min(score, where(kv_idx > q_idx, -inf, inf)) * 3.0",
        "max(score, -inf) + where(h > 0, inf, score)",
    ],
)
def test_score_derivatives_match_finite_differences(score):
    """sympy's derivative, as the kernels evaluate it, against central differences of the
    expression, where it is finite and away from its kinks."""
    expr = typed(score, want=Type.FLOAT)
    derivative = score_derivative(expr, {INT_PARAM: Type.INT, FLOAT_PARAM: Type.FLOAT})
    s = np.linspace(-2.95, 3.05, 41)[None, None, None, :]  # (not at where's cut, 1.0)
    env = {"q_idx": np.arange(4)[None, None, :, None], "kv_idx": 2, "b": 0, "h": np.arange(2)[None, :, None, None]}
    env |= {"q_len": 4, "kv_len": 4, INT_PARAM: 3, FLOAT_PARAM: 5.0}
    f = lambda x: np.broadcast_to(evaluate(expr, {**env, "score": x}), (1, 2, 4, 41))
    step = 1e-6
    numeric = (f(s + step) - f(s - step)) / (2 * step)
    finite = np.isfinite(f(s))
    got = np.broadcast_to(evaluate(derivative, {**env, "score": s}), finite.shape)
    assert finite.any() and (np.isfinite(numeric) == finite).all()
    np.testing.assert_allclose(got[finite], numeric[finite], rtol=1e-5, atol=1e-6)
    assert (got[np.isneginf(f(s))] == 0).all()  # a key the score drops gets no gradient


@pytest.mark.parametrize(
    "mask",
    [
        "q_idx >= kv_idx and sin(0.3 * (q_idx - kv_idx)) > -0.5",
        "exp2(q_idx // 16) >= kv_idx or log2(kv_idx + 1.0) < 2.5",
        "kv_idx < inf and q_idx - kv_idx < where(h > 0, 40.0, inf)",
        "keep[b] or q_idx >= kv_idx + 3",
        "q_idx >= kv_idx and not keep_kv[b, kv_idx]",
    ],
)
def test_masks_with_functions_infinities_and_bools_get_sound_tile_classes(mask):
    """No closed form is needed for these; a tile the analysis calls EMPTY or FULL must be so."""
    params = '\n[params]\nkeep = "bool[batch]"' if "keep[" in mask else ""
    params += '\n[params]\nkeep_kv = "bool[batch, kv_len]"' if "keep_kv" in mask else ""
    spec = harness.spec_from_text(spec_toml(mask) + params + "\n")
    rng = np.random.default_rng(2)
    tensors = {"keep": np.array([True, False]), "keep_kv": rng.random((2, 150)) < 0.5}
    for block_q, block_kv, q_len, kv_len, b, h in [(16, 32, 150, 130, 0, 0), (32, 16, 90, 150, 1, 1)]:
        bounds = analyse_mask(spec.mask, {}, block_kv)
        classes = classify(
            bounds, q_len=q_len, kv_len=kv_len, block_q=block_q, block_kv=block_kv, b=b, h=h, params=tensors
        )
        env = {**tensors, "b": b, "h": h, "q_idx": np.arange(q_len)[:, None], "kv_idx": np.arange(kv_len)[None, :]}
        dense = np.broadcast_to(evaluate(spec.mask, {**env, "q_len": q_len, "kv_len": kv_len}), (q_len, kv_len))
        want = brute_force(dense, block_q, block_kv)
        assert not ((classes == EMPTY) & (want != EMPTY)).any() and not ((classes == FULL) & (want != FULL)).any()
