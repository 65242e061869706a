"""Hypothesis strategies: masks and score expressions drawn from the grammar, specs, shapes.

Masks are and/or/not trees over atoms that cover every class the tile analysis distinguishes:
affine bounds on kv_idx (causal, windows, prefixes, with literals, params, b and h), conditions
on q_idx alone, and atoms it cannot bound (floor division, modulo, |coefficient| > 1).
"""

from __future__ import annotations

import datetime
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import strategies as st

from attngen import ir

INT_PARAM = "w"  # an int param some atoms read
FLOAT_PARAM = "cap"  # a float param some score expressions read


@st.composite
def _int_term(draw, lo: int, hi: int) -> str:
    """An int operand: a literal or the int param (drawn value lives in the problem)."""
    return draw(st.one_of(st.integers(lo, hi).map(str), st.just(INT_PARAM)))


@st.composite
def mask_atoms(draw) -> str:
    c = draw(_int_term(-40, 200))
    n = draw(st.integers(1, 70))
    return draw(
        st.sampled_from(
            [
                "q_idx >= kv_idx",
                "q_idx <= kv_idx",
                f"q_idx - kv_idx < {c}",
                f"kv_idx - q_idx <= {c}",
                f"kv_idx < {c}",
                f"kv_idx >= {c}",
                f"q_idx >= {c}",
                f"q_idx < {c}",
                f"2 * q_idx >= kv_idx + {c}",
                f"q_idx + kv_idx < {c} + 100",
                f"kv_idx <= {n} * h + {c}",
                f"q_idx - kv_idx != {n}",
                f"kv_idx == q_idx - {n}",
                f"q_idx // {n} == kv_idx // {n}",
                f"(q_idx - kv_idx) % {n} == 0",
                f"q_idx >= 2 * kv_idx - {n}",
                f"abs(q_idx - kv_idx) < {n}",
                f"kv_idx < {c} or b == 1",
            ]
        )
    )


def masks(max_depth: int = 2) -> st.SearchStrategy[str]:
    return st.recursive(
        mask_atoms(),
        lambda inner: st.one_of(
            st.tuples(inner, inner).map(lambda t: f"({t[0]}) and ({t[1]})"),
            st.tuples(inner, inner).map(lambda t: f"({t[0]}) or ({t[1]})"),
            inner.map(lambda m: f"not ({m})"),
        ),
        max_leaves=2**max_depth,
    )


def score_exprs() -> st.SearchStrategy[str]:
    return st.sampled_from(
        [
            f"{FLOAT_PARAM} * tanh(score / {FLOAT_PARAM})",
            "score * 1.5 - 0.25",
            "score + 0.05 * (kv_idx - q_idx)",
            "where(q_idx >= kv_idx, score, score / 2)",
            "max(score, -1.0) + min(score, 2) * 0.5",
            "score - abs(score) * 0.1 + 0.01 * h",
            "score + log(1.0 + exp(-abs(score)))",
            "sqrt(score * score + 1.0)",
            "score + (q_idx % 7) / 7",
            # Strongly biased scores (distance penalties, ALiBi): far keys' logits are very negative,
            # which fp16's P loses when a row's running max is wrong (tests/test_numerics.py).
            "score - 0.05 * abs(q_idx - kv_idx)",
            "score - 0.125 * (q_idx - kv_idx)",
            "score + 0.5 * sin(score) - 0.25 * cos(2.0 * score)",
            "score + tan(0.5 * tanh(score))",  # tanh keeps tan's argument far from its poles
            "log2(1.0 + exp2(score)) + 0.01 * (q_idx % 5)",
            # -inf drops keys as FlexAttention's score_mod does; a row may lose all of them.
            "where(kv_idx > q_idx + 20, -inf, score)",
            "min(score, where(q_idx - kv_idx > 30, -inf, inf))",
        ]
    )


@dataclass(frozen=True)
class DrawnSpec:
    """A drawn spec's TOML text and the runtime params its expressions need."""

    text: str
    params: dict = field(default_factory=dict)


def uses(name: str, *exprs: str | None) -> bool:
    return any(e is not None and re.search(rf"\b{name}\b", e) for e in exprs)


def spec_toml(
    mask: str | None = None,
    score: str | None = None,
    head_dim: int = 64,
    extra: tuple[str, ...] = (),
    sink: str | None = None,
) -> str:
    """Spec text for a mask, a score and a sink expression, declaring the drawn params they read."""
    lines = ['name = "drawn"', f"head_dim = {head_dim}", *extra]
    if mask == "causal":
        lines += ["[mask]", "causal = true"]
    elif mask is not None:
        lines += ["[mask]", f'expr = "{mask}"']
    if score is not None:
        lines += ["[score]", f'expr = "{score}"']
    if sink is not None:
        lines += ["[sink]", f'expr = "{sink}"']
    params = [f'{INT_PARAM} = "int"'] * uses(INT_PARAM, mask, score) + [f'{FLOAT_PARAM} = "float"'] * uses(
        FLOAT_PARAM, mask, score, sink
    )
    if params:
        lines += ["[params]", *params]
    return "\n".join(lines) + "\n"


@st.composite
def specs(draw, dtypes=("float32", "float16", "bfloat16"), head_dims=(16, 32, 40, 64, 80, 128)) -> DrawnSpec:
    mask = draw(st.one_of(st.none(), st.just("causal"), masks()))
    score = draw(st.one_of(st.none(), score_exprs()))
    params = {}
    if uses(INT_PARAM, mask, score):
        params[INT_PARAM] = draw(st.integers(-20, 150))
    if uses(FLOAT_PARAM, mask, score):
        params[FLOAT_PARAM] = draw(st.sampled_from([5.0, 20.0, 50.0]))
    config = (
        f'dtype = "{draw(st.sampled_from(dtypes))}"',
        "[triton]",
        f"block_m = {draw(st.sampled_from([16, 32, 64]))}",
        f"block_n = {draw(st.sampled_from([16, 32, 64]))}",
        "num_warps = 4",
        "num_stages = 2",
        f"dq_block_m = {draw(st.sampled_from([16, 32, 64]))}",
        f"dq_block_n = {draw(st.sampled_from([16, 32, 64]))}",
        "dq_num_warps = 4",
        "dq_num_stages = 2",
        f"dkdv_block_m = {draw(st.sampled_from([16, 32, 64]))}",
        f"dkdv_block_n = {draw(st.sampled_from([16, 32, 64]))}",
        "dkdv_num_warps = 4",
        "dkdv_num_stages = 2",
        "[pallas_tpu]",
        f"block_q = {draw(st.sampled_from([8, 16, 32, 64, 128]))}",
        f"block_kv = {draw(st.sampled_from([128, 256]))}",
    )
    # Tables must follow the top-level keys: put the config tables after mask/score/params.
    text = (
        spec_toml(mask, score, head_dim=draw(st.sampled_from(head_dims)), extra=config[:1])
        + "\n".join(config[1:])
        + "\n"
    )
    return DrawnSpec(text, params)


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    q_len: int
    kv_len: int


def shapes(max_len: int = 300) -> st.SearchStrategy[Shape]:
    """Small problems with odd lengths and q_len != kv_len."""
    return st.builds(
        Shape,
        batch=st.integers(1, 2),
        heads=st.integers(1, 3),
        q_len=st.integers(1, max_len),
        kv_len=st.integers(1, max_len),
    )


# ----------------------------------------------------------------------------- fuzzing the front end
#
# The strategies below feed the front end what a careless or hostile user could write: expression
# trees of any shape (well-typed or not, with constants that overflow or divide by zero), TOML
# documents with a value of any type at any key, and valid specs with their bytes mutated.

_INT_OPS = ("+", "-", "*", "//", "%")
_FLOAT_OPS = ("+", "-", "*", "/")
_COMPARISONS = ("==", "!=", "<", "<=", ">", ">=")
_UNARY_FLOAT = ("exp", "exp2", "log", "log2", "sqrt", "sin", "cos", "tan", "tanh", "abs")
# Literals at and past the edges of int32 and float32, inf, and zeros to divide by.
_EDGE_INTS = ("0", "1", "2147483647", "2147483648", "99999999999", "1" * 50)
_EDGE_FLOATS = ("0.0", "1.0", ".5", "5.", "3.4e38", "3.5e38", "1e999", "1e-38", "1e-999", "1.17549435e-38", "inf")
_ANY_NAMES = ("q_idx", "kv_idx", "b", "h", "score", INT_PARAM, FLOAT_PARAM, "__import__", "tl", "jnp", "param_w", "x")


def _int_literals(edges: bool = True) -> st.SearchStrategy[str]:
    small = st.integers(0, 300).map(str)
    return st.one_of(small, st.integers(0, 2**40).map(str), st.sampled_from(_EDGE_INTS)) if edges else small


def _float_literals(edges: bool = True) -> st.SearchStrategy[str]:
    if not edges:
        return st.floats(min_value=0.0, max_value=100.0).map(repr)
    finite = st.floats(min_value=0.0, allow_nan=False, allow_infinity=False).map(repr)
    return st.one_of(finite, st.sampled_from(_EDGE_FLOATS))


@st.composite
def typed_expressions(draw, want: str = "bool", allow_score: bool = False, depth: int = 3, edges: bool = True) -> str:
    """A well-typed expression of type `want` ("bool", "int" or "float") in the spec language.

    With `edges`, its constants are drawn from the edges too (int32 and float32 limits and past
    them), so a share of these overflow; any may divide by zero or take the log of a negative
    number. The front end must reject those with an error, never crash, and build the rest.
    """

    def sub(t: str) -> st.SearchStrategy[str]:
        return typed_expressions(t, allow_score, depth - 1, edges)

    leaf = depth <= 0 or draw(st.integers(0, 3)) == 0
    if want == "int":
        if leaf:
            return draw(st.one_of(st.sampled_from(("q_idx", "kv_idx", "b", "h", INT_PARAM)), _int_literals(edges)))
        form = draw(st.sampled_from(("op", "neg", "abs", "minmax", "where")))
        if form == "op":
            return f"({draw(sub('int'))}) {draw(st.sampled_from(_INT_OPS))} ({draw(sub('int'))})"
        if form == "minmax":
            return f"{draw(st.sampled_from(('min', 'max')))}({draw(sub('int'))}, {draw(sub('int'))})"
        if form == "where":
            return f"where({draw(sub('bool'))}, {draw(sub('int'))}, {draw(sub('int'))})"
        return f"{'-' if form == 'neg' else 'abs'}({draw(sub('int'))})"
    if want == "float":
        if leaf:
            names = ("score", FLOAT_PARAM) if allow_score else (FLOAT_PARAM,)
            return draw(st.one_of(st.sampled_from(names), _float_literals(edges)))
        form = draw(st.sampled_from(("op", "int_div", "neg", "func", "minmax", "where")))
        number = st.sampled_from(("float", "int"))
        if form == "op":
            return f"({draw(sub('float'))}) {draw(st.sampled_from(_FLOAT_OPS))} ({draw(sub(draw(number)))})"
        if form == "int_div":
            return f"({draw(sub('int'))}) / ({draw(sub('int'))})"
        if form == "func":
            return f"{draw(st.sampled_from(_UNARY_FLOAT))}({draw(sub(draw(number)))})"
        if form == "minmax":
            return f"{draw(st.sampled_from(('min', 'max')))}({draw(sub('float'))}, {draw(sub(draw(number)))})"
        if form == "where":
            return f"where({draw(sub('bool'))}, {draw(sub('float'))}, {draw(sub(draw(number)))})"
        return f"-({draw(sub('float'))})"
    number = st.sampled_from(("int", "float"))
    if leaf:
        return f"({draw(sub(draw(number)))}) {draw(st.sampled_from(_COMPARISONS))} ({draw(sub(draw(number)))})"
    form = draw(st.sampled_from(("compare", "logic", "not", "equal", "where")))
    if form == "compare":
        return f"({draw(sub(draw(number)))}) {draw(st.sampled_from(_COMPARISONS))} ({draw(sub(draw(number)))})"
    if form == "logic":
        return f"({draw(sub('bool'))}) {draw(st.sampled_from(('and', 'or')))} ({draw(sub('bool'))})"
    if form == "equal":
        return f"({draw(sub('bool'))}) {draw(st.sampled_from(('==', '!=')))} ({draw(sub('bool'))})"
    if form == "where":
        return f"where({draw(sub('bool'))}, {draw(sub('bool'))}, {draw(sub('bool'))})"
    return f"not ({draw(sub('bool'))})"


def expression_texts() -> st.SearchStrategy[str]:
    """Any tree the grammar can spell and many it cannot type: every operator over operands of
    any type, calls of known and unknown functions with any number of arguments, unknown and
    dunder names, edge literals, optional parentheses, and raw character soup."""
    leaves = st.one_of(st.sampled_from(_ANY_NAMES), _int_literals(), _float_literals())
    operators = st.sampled_from((*_INT_OPS, "/", *_COMPARISONS, "and", "or"))
    functions = st.sampled_from((*ir.FUNCTIONS, "where", "frob", "__import__", "eval"))

    def grow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        maybe_parens = st.tuples(inner, st.booleans()).map(lambda t: f"({t[0]})" if t[1] else t[0])
        return st.one_of(
            st.tuples(maybe_parens, operators, maybe_parens).map(" ".join),
            maybe_parens.map(lambda x: f"-{x}"),
            maybe_parens.map(lambda x: f"not {x}"),
            st.tuples(functions, st.lists(inner, max_size=4)).map(lambda t: f"{t[0]}({', '.join(t[1])})"),
        )

    soup = st.text(st.sampled_from("q_idxkvbhscore0123456789.+-*/%<>=!() ,eE\t'\"\\[]{}#\n"), max_size=40)
    return st.one_of(st.recursive(leaves, grow, max_leaves=8), soup, st.text(max_size=20))


@st.composite
def exact_masks(draw, depth: int = 2) -> str:
    """Masks whose every value the kernels compute exactly: int arithmetic on positions, b, h and
    the int param with small literals (no overflow), division only by positive literals."""

    @st.composite
    def ints(draw, depth: int) -> str:
        if depth == 0 or draw(st.integers(0, 2)) == 0:
            return draw(
                st.one_of(st.sampled_from(("q_idx", "kv_idx", "b", "h", INT_PARAM)), st.integers(0, 40).map(str))
            )
        form = draw(st.sampled_from(("add", "sub", "scale", "div", "mod", "neg", "abs", "min", "max", "where")))
        a = draw(ints(depth - 1))
        if form in ("add", "sub"):
            return f"({a}) {'+' if form == 'add' else '-'} ({draw(ints(depth - 1))})"
        if form == "scale":
            return f"{draw(st.integers(-3, 3))} * ({a})"
        if form in ("div", "mod"):
            return f"({a}) {'//' if form == 'div' else '%'} {draw(st.integers(1, 7))}"
        if form in ("min", "max"):
            return f"{form}({a}, {draw(ints(depth - 1))})"
        if form == "where":
            return f"where({draw(bools(depth - 1))}, {a}, {draw(ints(depth - 1))})"
        return f"-({a})" if form == "neg" else f"abs({a})"

    @st.composite
    def bools(draw, depth: int) -> str:
        compare = f"({draw(ints(depth))}) {draw(st.sampled_from(_COMPARISONS))} ({draw(ints(depth))})"
        if depth == 0 or draw(st.integers(0, 2)) == 0:
            return compare
        form = draw(st.sampled_from(("and", "or", "not", "equal")))
        if form == "not":
            return f"not ({draw(bools(depth - 1))})"
        op = draw(st.sampled_from(("==", "!="))) if form == "equal" else form
        return f"({draw(bools(depth - 1))}) {op} ({draw(bools(depth - 1))})"

    return draw(bools(depth))


@st.composite
def exact_specs(draw) -> DrawnSpec:
    """Specs whose kernels must match the oracle: masks from masks() or exact_masks(), score
    expressions from score_exprs(), valid small tiles; head_dim and dtype drawn."""
    mask = draw(st.one_of(st.none(), st.just("causal"), masks(), exact_masks()))
    score = draw(st.one_of(st.none(), score_exprs()))
    # A sink now and then: constant, per head, or from a param (rows with no key then average to 0
    # and take the sink as their LSE).
    sink = draw(st.one_of(st.none(), st.sampled_from(["1.5", "0.5 * h - 1.0", f"0.05 * {FLOAT_PARAM} - 1.0"])))
    params = {}
    if uses(INT_PARAM, mask, score):
        params[INT_PARAM] = draw(st.integers(-20, 150))
    if uses(FLOAT_PARAM, mask, score, sink):
        params[FLOAT_PARAM] = draw(st.sampled_from([5.0, 20.0, 50.0]))
    head_dim = draw(st.sampled_from([16, 40, 64]))
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    text = spec_toml(mask, score, head_dim=head_dim, extra=(f'dtype = "{dtype}"',), sink=sink)
    text += "\n".join(
        (
            "[triton]",
            f"block_m = {draw(st.sampled_from([16, 32, 64]))}",
            f"block_n = {draw(st.sampled_from([16, 32, 64]))}",
            "[pallas_tpu]",
            f"block_q = {draw(st.sampled_from([8, 16, 32]))}",
            "block_kv = 128",
        )
    )
    return DrawnSpec(text + "\n", params)


# --- TOML of any shape


def toml_literal(value) -> str:
    """`value` written as a TOML value (tomllib reads it back as an equal value)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are a subset of TOML's
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    return "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)} = {toml_literal(v)}" for k, v in value.items()) + "}"


def toml_values() -> st.SearchStrategy:
    """A value of any TOML type: huge ints, NaN and infinities, strings of any characters,
    dates and times, arrays and inline tables."""
    scalars = st.one_of(
        st.integers(-(2**70), 2**70),
        st.floats(),
        st.booleans(),
        st.text(max_size=12),
        st.dates(),
        st.datetimes(),
        st.times(),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
        max_leaves=6,
    )


def _sensible_values() -> dict[str | None, dict[str, st.SearchStrategy]]:
    """Per table, per key, values of the type the spec wants there; most are valid, some are
    not (a name with a space or a newline, head_dim 8, block_m 100, block_q 12)."""
    return {
        None: {
            "name": st.sampled_from(["drawn", "Bad Name", "drawn\n", "import"]),
            "head_dim": st.sampled_from([16, 64, 256, 8]),
            "dtype": st.sampled_from(["float32", "bfloat16", "float8"]),
        },
        "mask": {"causal": st.booleans(), "expr": st.one_of(masks(), typed_expressions("bool"))},
        "score": {"expr": st.one_of(score_exprs(), typed_expressions("float", allow_score=True))},
        "params": {INT_PARAM: st.sampled_from(["int", "float", "long"]), FLOAT_PARAM: st.just("float")},
        "triton": {k: st.sampled_from([16, 32, 64, 100]) for k in ("block_m", "block_n", "num_warps", "num_stages")},
        "pallas_tpu": {
            k: st.sampled_from([8, 128, 256, 12, 1 << 24]) for k in ("block_q", "block_kv", "vmem_limit_bytes")
        },
    }


@st.composite
def toml_documents(draw) -> str:
    """Spec-shaped TOML: the schema's keys (and unknown ones) at the top level and in each table,
    each holding a value the spec accepts or a value of any TOML type. Tables are written as
    [headers], inline tables or dotted keys, so every form of TOML reaches the validator."""
    sensible = _sensible_values()
    any_value = toml_values()

    def entries(table: str | None) -> dict[str, str]:
        known = sensible[table]
        keys = draw(st.lists(st.sampled_from(sorted(known)), unique=True))
        keys += draw(st.lists(st.text(min_size=1, max_size=8), max_size=2))  # unknown keys
        return {k: toml_literal(draw(st.one_of(known[k], any_value) if k in known else any_value)) for k in keys}

    def key(k: str) -> str:
        return (
            k if k and all(c.isascii() and (c.isalnum() or c in "_-") for c in k) else json.dumps(k, ensure_ascii=False)
        )

    top = [f"{key(k)} = {v}" for k, v in entries(None).items()]
    sections = []
    for table in draw(st.lists(st.sampled_from([t for t in sensible if t is not None]), unique=True)):
        body = entries(table)
        style = draw(st.sampled_from(["header", "inline", "dotted", "not a table"]))
        if style == "header":
            sections.append(f"[{table}]\n" + "".join(f"{key(k)} = {v}\n" for k, v in body.items()))
        elif style == "inline":
            top.append(f"{table} = {{" + ", ".join(f"{key(k)} = {v}" for k, v in body.items()) + "}")
        elif style == "dotted":
            top += [f"{table}.{key(k)} = {v}" for k, v in body.items()]
        else:
            top.append(f"{table} = {toml_literal(draw(any_value))}")
    return "\n".join(top) + "\n" + "\n".join(sections)


# --- valid specs, mutated

# Byte strings that break TOML, UTF-8 or the expression language in interesting ways.
# fmt: off
_MUTATION_TOKENS = (
    b'"', b"'", b'"""', b"[", b"]", b"[[", b"{", b"}", b"=", b".", b"#", b"\n", b"\r", b"\\", b"\\u0000", b"\\n",
    b"\x00", b"\xff", b"\xc3", b"\xef\xbb\xbf", b"\xe2\x80\xa8", b"\xd0\xb0", b"nan", b"inf", b"1e999",
    b"99999999999999999999999", b"true", b"1979-05-27", b"__import__", b"score", b"q_idx", b"(", b")", b" and ",
)
# fmt: on
ROOT = Path(__file__).resolve().parent.parent


@st.composite
def mutated_specs(draw) -> bytes:
    """The bytes of a valid spec (one of specs/ or a drawn one) after a few random edits: bytes
    and tokens inserted, ranges deleted or duplicated, bytes replaced."""
    examples = [p.read_bytes() for p in sorted((ROOT / "specs").glob("*.toml"))]
    data = bytearray(draw(st.one_of(st.sampled_from(examples), specs().map(lambda s: s.text.encode()))))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["insert", "token", "delete", "duplicate", "replace"]))
        if edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=6))
        elif edit == "token":
            data[at:at] = draw(st.sampled_from(_MUTATION_TOKENS))
        elif edit == "delete":
            del data[at : draw(st.integers(at, min(len(data), at + 40)))]
        elif edit == "duplicate":
            data[at:at] = data[at : draw(st.integers(at, min(len(data), at + 40)))]
        elif data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
    return bytes(data)
