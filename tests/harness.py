"""Build generated packages on the fly, run them on the CPU, and judge them against the oracle.

The exactness rule (the FlashAttention test rule, against the float64 reference on the same
rounded inputs), its floors and its same-precision baselines are attngen.exactness's; this module
feeds it the tests' problems.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import attngen
from attngen import exactness
from attngen.exactness import round_to
from attngen.reference import attention_ref
from attngen.spec import Spec, parse_spec, retarget
from attngen.testing import (  # noqa: F401 - the tests reach them through the harness
    example_params,
    random_cu_seqlens,
    varlen_params,
)

_BUILD_ROOT: Path | None = None


def build_dir() -> Path:
    global _BUILD_ROOT
    if _BUILD_ROOT is None:
        import tempfile

        _BUILD_ROOT = Path(tempfile.mkdtemp(prefix="attngen-tests-"))
    return _BUILD_ROOT


def load_target(spec: Spec, target: str):
    """attngen.load into a scratch folder of this test run (not the user's cache).

    Modules are keyed by the digest of their rendered source, not by spec.sha256: tests replace
    tile sizes on a spec (tests/test_variants.py's small_tiles) without changing the hash, and
    each such spec must run its own kernels.
    """
    return attngen.load(spec, target, cache_dir=build_dir())


def compiled_structure(script: str, *args: str) -> list:
    """What `script` prints, one JSON value per line, run with args in a process of its own: it
    compiles kernels for a GPU (TRITON_INTERPRET must be off when triton is imported)."""
    import json
    import os
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**os.environ, "TRITON_INTERPRET": "0"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith(("{", "["))]


def spec_from_text(text: str) -> Spec:
    return parse_spec(text, "<drawn spec>")


# ----------------------------------------------------------------------------- inputs and oracle


@dataclass(frozen=True)
class Problem:
    """Inputs of one check: float32 arrays holding values exactly representable in `dtype`."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dtype: str
    scale: float | None
    params: dict


def make_problem(
    spec: Spec, batch: int, heads: int, q_len: int, kv_len: int, seed: int, params: dict, scale=None, kv_heads=None
) -> Problem:
    """Fresh random inputs (never zeros), rounded to the spec's dtype; kv_heads < heads for GQA."""
    rng = np.random.default_rng(seed)
    shape_q = (batch, heads, q_len, spec.head_dim)
    shape_k = (batch, kv_heads or heads, kv_len, spec.head_dim)
    shape_v = (batch, kv_heads or heads, kv_len, spec.value_dim)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in (shape_q, shape_k, shape_v))
    q, k, v = (round_to(x, spec.dtype) for x in (q, k, v))
    return Problem(q, k, v, spec.dtype, scale, params)


def params_as(params: dict, convert) -> dict:
    """params with each tensor (a numpy array) converted by `convert` (torch.as_tensor, jnp.asarray)."""
    return {name: convert(value) if isinstance(value, np.ndarray) else value for name, value in params.items()}


def assert_exact(spec: Spec, p: Problem, out: np.ndarray, lse: np.ndarray) -> dict:
    """Check a kernel's (out, lse) by attngen.exactness's rule; returns the measured errors."""
    ref_out, ref_lse = attention_ref(spec, p.q, p.k, p.v, scale=p.scale, **p.params)
    baseline = None
    if p.dtype != "float32":
        baseline = exactness.lowp_baseline(spec, p.q, p.k, p.v, p.dtype, scale=p.scale, params=p.params)
    return exactness.assert_forward(p.dtype, out, lse, ref_out, ref_lse, baseline).errors


# ----------------------------------------------------------------------------- running targets


def run_triton(spec: Spec, p: Problem):
    import torch

    module = load_target(spec, "triton_gpu")
    dtype = getattr(torch, p.dtype)
    q, k, v = (torch.from_numpy(x).to(dtype) for x in (p.q, p.k, p.v))
    out, lse = module.attention(q, k, v, scale=p.scale, return_lse=True, **params_as(p.params, torch.as_tensor))
    return out.float().numpy(), lse.numpy()


def run_pallas(spec: Spec, p: Problem, interpret=True):
    import jax.numpy as jnp

    module = load_target(spec, "pallas_tpu")
    dtype = getattr(jnp, p.dtype)
    q, k, v = (jnp.asarray(x).astype(dtype) for x in (p.q, p.k, p.v))
    out, lse = module.attention(
        q, k, v, scale=p.scale, return_lse=True, interpret=interpret, **params_as(p.params, jnp.asarray)
    )
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def with_dtype(spec: Spec, dtype: str) -> Spec:
    """The spec as if written for another dtype: its unpinned [triton] keys from that dtype's tuned
    entry, and a different package hash."""
    import dataclasses

    return dataclasses.replace(
        retarget(spec, spec.head_dim, dtype), sha256=hashlib.sha256(f"{spec.sha256}:{dtype}".encode()).hexdigest()
    )


# ----------------------------------------------------------------------------- gradients


@dataclass(frozen=True)
class Cotangents:
    """Gradients flowing into (out, lse): fresh random values, float32 holding dtype values."""

    dout: np.ndarray
    dlse: np.ndarray


def make_cotangents(p: Problem, seed: int) -> Cotangents:
    rng = np.random.default_rng(seed + 1)
    dout = round_to(rng.standard_normal((*p.q.shape[:3], p.v.shape[3])).astype(np.float32), p.dtype)
    dlse = rng.standard_normal(p.q.shape[:3]).astype(np.float32)
    return Cotangents(dout, dlse)


def assert_grads_exact(spec: Spec, p: Problem, c: Cotangents, grads) -> dict:
    """Kernel gradients against float64 autograd by attngen.exactness's rule; returns the errors."""
    inputs = (spec, p.q, p.k, p.v, c.dout, c.dlse)
    ref = exactness.reference_grads(*inputs, scale=p.scale, params=p.params)
    lowp = None
    if p.dtype != "float32":
        lowp = exactness.reference_grads(*inputs, dtype=p.dtype, scale=p.scale, params=p.params)
    return exactness.assert_grads(p.dtype, grads, ref, lowp).errors


def run_triton_grad(spec: Spec, p: Problem, c: Cotangents):
    import torch

    module = load_target(spec, "triton_gpu")
    dtype = getattr(torch, p.dtype)
    q, k, v = (torch.from_numpy(x).to(dtype).requires_grad_() for x in (p.q, p.k, p.v))
    out, lse = module.attention(q, k, v, scale=p.scale, return_lse=True, **params_as(p.params, torch.as_tensor))
    grads = torch.autograd.grad([out, lse], [q, k, v], [torch.from_numpy(c.dout).to(dtype), torch.from_numpy(c.dlse)])
    return [g.float().numpy() for g in grads]


def run_pallas_grad(spec: Spec, p: Problem, c: Cotangents, interpret=True):
    import jax
    import jax.numpy as jnp

    module = load_target(spec, "pallas_tpu")
    dtype = getattr(jnp, p.dtype)
    q, k, v = (jnp.asarray(x).astype(dtype) for x in (p.q, p.k, p.v))

    def f(q, k, v):
        return module.attention(
            q, k, v, scale=p.scale, return_lse=True, interpret=interpret, **params_as(p.params, jnp.asarray)
        )

    _, vjp = jax.vjp(f, q, k, v)
    grads = vjp((jnp.asarray(c.dout).astype(dtype), jnp.asarray(c.dlse)))
    return [np.asarray(g.astype(jnp.float32)) for g in grads]


# (run, run_grad) per target, for tests that treat both targets alike.
TARGETS = {"triton": (run_triton, run_triton_grad), "pallas": (run_pallas, run_pallas_grad)}
