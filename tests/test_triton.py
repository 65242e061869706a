"""Generated Triton kernels (under TRITON_INTERPRET=1) against the float64 oracle."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen.spec import load_spec
from tests import harness
from tests.strategies import shapes, specs

SPECS = sorted(Path(__file__).resolve().parent.parent.joinpath("specs").glob("*.toml"))
SPEC_PARAMS = {"sliding_window": {"window": 70}, "prefix_lm": {"prefix": 45}, "softcap": {"softcap": 20.0}, "strided": {"stride": 24}}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_spec_examples(spec_file, dtype):
    """Each spec in specs/, with its own block sizes, at lengths that leave tails."""
    spec = load_spec(spec_file)
    spec = harness.with_dtype(spec, dtype)
    params = SPEC_PARAMS.get(spec.name, {})
    p = harness.make_problem(spec, batch=1, heads=2, q_len=300, kv_len=277, seed=hash(dtype) % 1000, params=params)
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))


@settings(max_examples=40)
@given(drawn=specs(), shape=shapes(), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([None, 0.05, 0.3]))
def test_drawn_specs(drawn, shape, seed, scale):
    spec = harness.spec_from_text(drawn.text)
    p = harness.make_problem(spec, shape.batch, shape.heads, shape.q_len, shape.kv_len, seed, drawn.params, scale)
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))
