"""Hypothesis strategies: masks and score expressions drawn from the grammar, specs, shapes.

Masks are and/or/not trees over atoms that cover every class the tile analysis distinguishes:
affine bounds on kv_idx (causal, windows, prefixes, with literals, params, b and h), conditions
on q_idx alone, and atoms it cannot bound (floor division, modulo, |coefficient| > 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hypothesis import strategies as st

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
    mask: str | None = None, score: str | None = None, head_dim: int = 64, extra: tuple[str, ...] = ()
) -> str:
    """Spec text for a mask and a score expression, declaring the drawn params they read."""
    lines = ['name = "drawn"', f"head_dim = {head_dim}", *extra]
    if mask == "causal":
        lines += ["[mask]", "causal = true"]
    elif mask is not None:
        lines += ["[mask]", f'expr = "{mask}"']
    if score is not None:
        lines += ["[score]", f'expr = "{score}"']
    params = [f'{INT_PARAM} = "int"'] * uses(INT_PARAM, mask, score) + [f'{FLOAT_PARAM} = "float"'] * uses(
        FLOAT_PARAM, mask, score
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
