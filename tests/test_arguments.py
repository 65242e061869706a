"""The generated functions' argument checks: one piece of code (a shared template partial) for
every target, so a bad argument gets the same error, with the same message, on each."""

import numpy as np
import pytest

from attngen.spec import load_spec
from tests import harness

BAD_SCALARS = [
    ({"window": 20.7}, TypeError, "param window must be an int, got 20.7"),
    ({"window": True}, TypeError, "param window must be an int, got True"),
    ({"window": "20"}, TypeError, "param window must be an int, got '20'"),
    ({"window": 2**31}, ValueError, "param window must fit in int32, got 2147483648"),
    ({}, TypeError, "takes params ['window']; missing ['window'], unknown []"),
    ({"window": 20, "wndow": 3}, TypeError, "missing [], unknown ['wndow']"),
]


MODULES = {"triton": "triton_gpu", "pallas": "pallas_tpu"}


def _array(target: str, x: np.ndarray):
    if target == "triton":
        import torch

        return torch.from_numpy(x)
    import jax.numpy as jnp

    return jnp.asarray(x)


def _inputs(target: str, spec, dtype="float32"):
    p = harness.make_problem(harness.with_dtype(spec, dtype), 1, 2, 16, 16, seed=0, params={})
    return tuple(_array(target, x) for x in (p.q, p.k, p.v))


def _call(target: str, spec, **params):
    module = harness.load_target(harness.with_dtype(spec, "float32"), MODULES[target])
    extra = {} if target == "triton" else {"interpret": True}
    with pytest.raises(Exception) as caught:
        module.attention(*_inputs(target, spec), **params, **extra)
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize(("params", "kind", "message"), BAD_SCALARS)
def test_bad_scalar_params_get_one_error_on_every_target(params, kind, message):
    spec = load_spec("specs/sliding_window.toml")
    errors = {target: _call(target, spec, **params) for target in sorted(harness.TARGETS)}
    for target, (raised, text) in errors.items():
        assert raised is kind and message in text, (target, raised, text)
    assert len(set(errors.values())) == 1, errors


def test_a_divisor_param_must_be_positive_on_every_target():
    spec = load_spec("specs/chunked.toml")
    for target in sorted(harness.TARGETS):
        raised, text = _call(target, spec, chunk=0)
        assert raised is ValueError and "param chunk divides in the spec's expressions" in text, target


def test_tensor_params_are_checked_alike():
    spec = load_spec("specs/alibi_slopes.toml")
    for target in sorted(harness.TARGETS):
        wrong_shape = np.ones(3, np.float32)  # declared [heads]: 2 here
        raised, text = _call(target, spec, slopes=_array(target, wrong_shape))
        assert raised is ValueError and "param slopes has shape [3], declared [heads]: heads = 2" in text, target
        raised, text = _call(target, spec, slopes=_array(target, np.ones(2, np.int32)))
        assert raised is TypeError and "param slopes must be float32, float16 or bfloat16" in text, target
