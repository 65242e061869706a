"""Generated Pallas TPU kernels, run on the CPU in interpret mode, against the float64 oracle."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen.spec import load_spec
from tests import harness
from tests.strategies import shapes, specs
from tests.test_triton import SPEC_PARAMS, SPECS


def _tpu_interpret_params():
    from jax.experimental.pallas import tpu as pltpu

    # Uninitialised memory reads as NaN, so a read of unwritten scratch shows in the output.
    return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")


def _races_found() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call

    races = interpret_pallas_call.races
    return races is not None and races.races_found


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_spec_examples_tpu_interpret(spec_file, dtype):
    """specs/ in TPU interpret mode: race detection on, scratch poisoned with NaN; small blocks so
    that the grid has EMPTY, PARTIAL and FULL tiles and a kv tail."""
    import dataclasses

    spec = harness.with_dtype(load_spec(spec_file), dtype)
    spec = dataclasses.replace(spec, pallas_tpu=dataclasses.replace(spec.pallas_tpu, block_q=64, block_kv=128))
    params = SPEC_PARAMS.get(spec.name, {})
    p = harness.make_problem(spec, batch=1, heads=2, q_len=300, kv_len=333, seed=7, params=params)
    out, lse = harness.run_pallas(spec, p, interpret=_tpu_interpret_params())
    assert not _races_found(), "TPU interpret mode detected a race"
    harness.assert_exact(spec, p, out, lse)


@settings(max_examples=25)
@given(drawn=specs(), shape=shapes(), seed=st.integers(0, 2**32 - 1), scale=st.sampled_from([None, 0.05, 0.3]))
def test_drawn_specs(drawn, shape, seed, scale):
    spec = harness.spec_from_text(drawn.text)
    p = harness.make_problem(spec, shape.batch, shape.heads, shape.q_len, shape.kv_len, seed, drawn.params, scale)
    harness.assert_exact(spec, p, *harness.run_pallas(spec, p))
