"""Fuzzing the front end: whatever comes in, the only failure is an AttngenError.

Front-end targets (load_spec / parse_spec, and the CLI): random bytes, mutated valid specs, TOML
of any shape with a value of any type at any key, and expression trees of any shape. A spec that
fails carries every problem with a file:line:col location and renders as printable text.
Build target: every drawn spec that passes validation builds (tile analysis, derivative, both
templates) or fails with an AttngenError. Exactness target: every drawn spec of exact_specs()
that passes validation builds, and its Triton and Pallas kernels match the float64 oracle.

Example counts: small in CI. For a long run set ATTNGEN_FUZZ_EXAMPLES=N (or HYPOTHESIS_PROFILE=long,
which means N=2000): each front-end target draws N examples, the slower targets a share of N.
    ATTNGEN_FUZZ_EXAMPLES=2500 pytest tests/test_fuzz.py --hypothesis-show-statistics
"""

import os
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from attngen.build import package_sources
from attngen.cli import main
from attngen.errors import AttngenError, SpecError
from attngen.spec import Spec, load_spec, parse_spec
from attngen.spec.positions import TomlPositions
from tests import harness
from tests.strategies import (
    FLOAT_PARAM,
    INT_PARAM,
    exact_specs,
    expression_texts,
    mutated_specs,
    shapes,
    specs,
    toml_documents,
    toml_literal,
    typed_expressions,
    uses,
)

LONG_RUN_EXAMPLES = 2000  # per front-end target under HYPOTHESIS_PROFILE=long


def examples(ci: int, share: float = 1.0) -> int:
    """`ci` examples in CI; in a long run, `share` of the long run's count (never fewer than ci)."""
    long_run = os.environ.get("ATTNGEN_FUZZ_EXAMPLES")
    if long_run is None and os.environ.get("HYPOTHESIS_PROFILE") == "long":
        long_run = LONG_RUN_EXAMPLES
    return max(ci, int(int(long_run) * share)) if long_run else ci


# The examples of a test share its tmp_path (each overwrites the one file it reads), which is what
# Hypothesis's function-scoped-fixture check warns about.
FUZZ_SETTINGS = {"suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]}


def assert_well_reported(error: SpecError) -> None:
    """Every problem has a location, and the report prints as it is (no control characters)."""
    assert error.diagnostics
    for d in error.diagnostics:
        assert d.location is not None and d.location.line >= 1 and d.location.col >= 1, d
    text = str(error)
    assert all(c.isprintable() or c in "\n\t" for c in text), repr(text)


def validated(load: Callable[[], Spec]) -> Spec | None:
    """The Spec load() returns, or None after checking that its SpecError is well reported; any
    other exception fails the test."""
    try:
        spec = load()
    except SpecError as e:
        assert_well_reported(e)
        event("invalid")
        return None
    event("valid")
    return spec


def load_bytes(data: bytes, folder: Path) -> Spec | None:
    path = folder / "fuzz.toml"
    path.write_bytes(data)
    return validated(lambda: load_spec(path))


def parse_or_report(text: str) -> Spec | None:
    return validated(lambda: parse_spec(text, "fuzz.toml"))


def assert_positions_agree_with_tomllib(text: str) -> None:
    """The scanner that locates errors reads every string value as tomllib does: each decoded
    character sits at its own source character, or at the backslash of its escape."""
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError, ValueError):
        return
    for path, offsets in TomlPositions(text).strings.items():
        value = data
        for key in path:
            if isinstance(value, list):  # inside an array of tables: not followed
                break
            assert key in value, f"the scanner read a key {path} that tomllib did not"
            value = value[key]
        else:
            assert isinstance(value, str) and len(offsets) == len(value) + 1, (path, value)
            assert_offsets_match(text, value, offsets)


def assert_offsets_match(text: str, value: str, offsets: list[int]) -> None:
    """Each character of a string value at its offset in text (or at its escape)."""
    for char, offset in zip(value, offsets):
        crlf = char == "\n" and text.startswith("\r\n", offset)  # tomllib reads CRLF in a string as "\n"
        assert text[offset] in (char, "\\") or crlf, (value, offset)


def spec_text(mask: str | None, score: str | None) -> str:
    """A spec with these expressions (any text, TOML-escaped), declaring the params they read."""
    lines = ['name = "fuzz"', "head_dim = 64"]
    lines += [f"[mask]\nexpr = {toml_literal(mask)}"] if mask is not None else []
    lines += [f"[score]\nexpr = {toml_literal(score)}"] if score is not None else []
    params = [
        f'{name} = "{kind}"' for name, kind in ((INT_PARAM, "int"), (FLOAT_PARAM, "float")) if uses(name, mask, score)
    ]
    return "\n".join(lines + (["[params]", *params] if params else [])) + "\n"


# ----------------------------------------------------------------------------- front end


@settings(max_examples=examples(300), **FUZZ_SETTINGS)
@given(data=st.binary(max_size=400))
def test_random_bytes(data, tmp_path):
    load_bytes(data, tmp_path)


@settings(max_examples=examples(300), **FUZZ_SETTINGS)
@given(data=mutated_specs())
def test_mutated_specs(data, tmp_path):
    load_bytes(data, tmp_path)
    assert_positions_agree_with_tomllib(data.decode("utf-8", "replace"))


@settings(max_examples=examples(300))
@given(text=toml_documents())
def test_toml_of_any_shape(text):
    parse_or_report(text)
    assert_positions_agree_with_tomllib(text)


@settings(max_examples=examples(300))
@given(
    mask=st.one_of(st.none(), expression_texts(), typed_expressions("bool")),
    score=st.one_of(st.none(), expression_texts(), typed_expressions("float", allow_score=True)),
)
def test_expression_trees(mask, score):
    parse_or_report(spec_text(mask, score))


# ----------------------------------------------------------------------------- build


@settings(max_examples=examples(40, share=0.2))
@given(
    mask=st.one_of(st.none(), typed_expressions("bool", depth=2, edges=False)),
    score=st.one_of(st.none(), typed_expressions("float", allow_score=True, depth=2, edges=False)),
)
def test_valid_specs_build(mask, score):
    """Past validation nothing fails but an AttngenError: not sympy, not Jinja, not a printer."""
    spec = parse_or_report(spec_text(mask, score))
    if spec is not None:
        try:
            sources = package_sources(spec)
        except AttngenError:
            event("valid, but the build refused it")
            return
        event("built")
        assert sorted(sources) == ["__init__.py", "pallas_tpu.py", "triton_gpu.py"]
        for name, source in sources.items():
            compile(source, name, "exec")  # valid Python


@settings(max_examples=examples(10, share=0.05), **FUZZ_SETTINGS)
@given(data=st.one_of(mutated_specs(), st.binary(max_size=200), specs().map(lambda s: s.text.encode())))
def test_cli_exits_0_or_2_and_never_prints_a_traceback(data, tmp_path, capsys):
    path = tmp_path / "fuzz.toml"
    path.write_bytes(data)
    status = main(["build", str(path), "--out", str(tmp_path / "out"), "--allow-outside"])
    event(f"exit {status}")
    assert status in (0, 2)
    assert "Traceback" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("target", ["triton", "pallas"])
@settings(max_examples=examples(3, share=0.01))
@given(drawn=exact_specs(), shape=shapes(max_len=80), seed=st.integers(0, 2**32 - 1))
def test_valid_drawn_specs_are_exact(target, drawn, shape, seed):
    spec = harness.spec_from_text(drawn.text)
    p = harness.make_problem(spec, shape.batch, shape.heads, shape.q_len, shape.kv_len, seed, drawn.params)
    run, _ = harness.TARGETS[target]
    harness.assert_exact(spec, p, *run(spec, p))
