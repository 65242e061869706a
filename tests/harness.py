"""Build generated packages on the fly, run them on the CPU, and judge them against the oracle.

Exactness rule (DESIGN.md): compared with the float64 reference on the same rounded inputs,
fp32 kernels must agree to ~1e-5; fp16/bf16 kernels may err by at most twice what a framework
implementation in the same precision errs, plus a small floor (the FlashAttention test rule).
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from attngen.build import import_generated, write_package
from attngen.reference import attention_ref, attention_ref_torch, dense_mask, evaluate, kv_heads_expanded, positions
from attngen.spec import Spec, parse_spec, retarget

_BUILD_ROOT: Path | None = None


def build_dir() -> Path:
    global _BUILD_ROOT
    if _BUILD_ROOT is None:
        import tempfile

        _BUILD_ROOT = Path(tempfile.mkdtemp(prefix="attngen-tests-"))
    return _BUILD_ROOT


def load_target(spec: Spec, target: str):
    """Build spec into a scratch folder and import its `target` module under a unique name."""
    digest = hashlib.sha256(spec.sha256.encode() + target.encode()).hexdigest()[:16]
    module_name = f"_attngen_test_{spec.name}_{target}_{digest}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    out = build_dir() / digest
    write_package(spec, out)
    return import_generated(out / spec.name / f"{target}.py", module_name)


def spec_from_text(text: str) -> Spec:
    return parse_spec(text, "<drawn spec>")


# ----------------------------------------------------------------------------- Triton interpreter


def fix_interpreter_bf16_dot() -> None:
    """Work around triton-lang/triton#11584 in the harness, not the kernels.

    The interpreter stores bf16 as raw uint16 bits and hands those bits to numpy: to matmul, and to
    the arithmetic of binary operators (so -x or x - y on bf16 tensors computes on the bits).
    Widen bf16 operands to float32 first (exact: bf16 is the top half of a float32); a bf16
    arithmetic result is rounded back to bf16 as the hardware would.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_attngen_bf16_fix", False):
        return
    original_dot, original_binary_op = builder.create_dot, builder.binary_op

    def widen(handle):
        if handle.dtype.scalar == tl.bfloat16:
            bits = handle.data.astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), tl.float32)
        return handle

    def create_dot(self, a, b, d, *args):
        return original_dot(self, widen(a), widen(b), d, *args)

    def binary_op(self, lhs, rhs, op):
        if lhs.dtype.scalar != tl.bfloat16:
            return original_binary_op(self, lhs, rhs, op)
        result = interpreter.TensorHandle(op(widen(lhs).data, widen(rhs).data).astype(np.float32), tl.float32)
        return self.cast_impl(result, tl.bfloat16)

    create_dot._attngen_bf16_fix = True
    builder.create_dot, builder.binary_op = create_dot, binary_op


# ----------------------------------------------------------------------------- inputs and oracle

_NUMPY_LOWP = {"float32": np.float32, "float16": np.float16}


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


def example_params(spec_name: str, batch: int, heads: int, q_len: int, kv_len: int, seed: int = 0) -> dict:
    """Runtime params for a spec of specs/ at this shape: fixed scalars, fresh random tensors."""
    rng = np.random.default_rng(seed)
    examples = {
        "alibi": lambda: {"num_heads": heads},
        "local_window": lambda: {"left": 50, "right": 20},
        "sliding_window": lambda: {"window": 70},
        "prefix_lm": lambda: {"prefix": 45},
        "softcap": lambda: {"softcap": 20.0},
        "strided": lambda: {"stride": 24},
        "chunked": lambda: {"chunk": 100},
        "alibi_slopes": lambda: {"slopes": rng.uniform(0.01, 0.5, heads).astype(np.float32)},
        # 33 buckets for distances -16..16: longer distances clamp to the table's ends.
        "relative_bias": lambda: {"rel_bias": rng.standard_normal((heads, 33)).astype(np.float32), "max_dist": 16},
        "bias": lambda: {"bias": rng.standard_normal((batch, heads, q_len, kv_len)).astype(np.float32)},
        # Some prefixes are negative or past the keys: all-causal and all-visible rows.
        "prefix_lm_batched": lambda: {"prefix": rng.integers(-5, kv_len + 5, batch).astype(np.int32)},
        "varlen": lambda: {  # each sequence of the batch packed its own way
            name: np.concatenate(rows)
            for name, *rows in zip(
                ("seq_q", "seq_kv", "pos_q", "pos_kv"),
                *(varlen_params(*random_cu_seqlens(rng, q_len, kv_len)).values() for _ in range(batch)),
            )
        },
        # Sorted ids: packed documents of random lengths (a query may start a document its keys lack).
        "document": lambda: {
            "seg_q": np.sort(rng.integers(0, 4, (batch, q_len)), axis=1).astype(np.int32),
            "seg_kv": np.sort(rng.integers(0, 4, (batch, kv_len)), axis=1).astype(np.int32),
        },
    }
    return examples[spec_name]() if spec_name in examples else {}


def random_cu_seqlens(rng, q_len: int, kv_len: int, count: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative lengths of `count` packed sequences of random lengths (some empty), as
    flash_attn_varlen_func takes them: [0, ..., q_len] and [0, ..., kv_len]."""
    cuts = lambda n: np.sort(np.concatenate([[0, n], rng.integers(0, n + 1, count - 1)]))
    return cuts(q_len).astype(np.int32), cuts(kv_len).astype(np.int32)


def varlen_params(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray) -> dict:
    """specs/varlen.toml's tensors from cumulative lengths (the README's recipe, in numpy): each
    token's sequence, and its position there, queries shifted to align the diagonals bottom-right."""
    lens_q, lens_k = np.diff(cu_seqlens_q), np.diff(cu_seqlens_k)
    seq_q = np.repeat(np.arange(len(lens_q)), lens_q)
    seq_kv = np.repeat(np.arange(len(lens_k)), lens_k)
    pos_q = np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[seq_q] + (lens_k - lens_q)[seq_q]
    pos_kv = np.arange(cu_seqlens_k[-1]) - cu_seqlens_k[seq_kv]
    return {
        name: x[None].astype(np.int32)
        for name, x in zip(("seq_q", "seq_kv", "pos_q", "pos_kv"), (seq_q, seq_kv, pos_q, pos_kv))
    }


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded (to nearest even) to dtype, returned as float32."""
    if dtype == "bfloat16":
        bits = x.astype(np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(np.float32)
    return x.astype(_NUMPY_LOWP[dtype]).astype(np.float32)


def lowp_baseline(spec: Spec, p: Problem) -> np.ndarray:
    """A plain implementation in the problem's precision: what a framework would compute.

    Scores come from a float32 matmul of the rounded inputs (as torch's bf16/fp16 matmuls
    accumulate in fp32), are rounded to the dtype, and so are the probabilities and the output.
    """
    batch, heads, q_len, head_dim = p.q.shape
    kv_len = p.k.shape[2]
    scale = p.scale if p.scale is not None else 1.0 / np.sqrt(head_dim)
    k, v = (kv_heads_expanded(x, heads) for x in (p.k, p.v))
    score = round_to(np.matmul(p.q, k.swapaxes(-1, -2)) * np.float32(scale), p.dtype).astype(np.float64)
    if spec.score is not None:
        env = {"score": score, **positions(batch, heads, q_len, kv_len), **p.params}
        score = np.broadcast_to(evaluate(spec.score, env), score.shape)
    score = np.where(dense_mask(spec, batch, heads, q_len, kv_len, p.params), score, -np.inf)
    row_max = score.max(axis=-1, keepdims=True, initial=-np.inf)
    probs = np.exp(score - np.where(np.isfinite(row_max), row_max, 0.0))
    total = probs.sum(axis=-1, keepdims=True)
    probs = round_to((probs / np.where(total == 0, 1.0, total)).astype(np.float32), p.dtype)
    return round_to(np.matmul(probs, v), p.dtype).astype(np.float64)


FLOOR = {"float32": 2e-5, "float16": 2e-4, "bfloat16": 2e-3}


def assert_exact(spec: Spec, p: Problem, out: np.ndarray, lse: np.ndarray) -> dict:
    """Check a kernel's (out, lse) against the float64 oracle; returns the measured errors."""
    ref_out, ref_lse = attention_ref(spec, p.q, p.k, p.v, scale=p.scale, **p.params)
    out = np.asarray(out, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not np.isnan(out).any(), "NaN in output"
    assert not np.isnan(lse).any(), "NaN in lse"
    err = np.abs(out - ref_out).max(initial=0.0)
    if p.dtype == "float32":
        allowed = FLOOR["float32"]
    else:
        baseline = np.abs(lowp_baseline(spec, p) - ref_out).max(initial=0.0)
        allowed = 2 * baseline + FLOOR[p.dtype]
    assert err <= allowed, f"max |out - ref| = {err:.3g} > allowed {allowed:.3g}"
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty), "lse is -inf exactly where a row sees no key"
    assert (out[empty] == 0).all(), "rows with no visible key must give 0"
    lse_err = np.abs(lse[~empty] - ref_lse[~empty]).max(initial=0.0)
    assert lse_err <= 1e-4 * max(1.0, np.abs(ref_lse[~empty]).max(initial=0.0)), f"lse error {lse_err:.3g}"
    return {"out": float(err), "lse": float(lse_err)}


# ----------------------------------------------------------------------------- running targets


def run_triton(spec: Spec, p: Problem):
    import torch

    fix_interpreter_bf16_dot()
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


def reference_grads(spec: Spec, p: Problem, c: Cotangents, dtype=None) -> list[np.ndarray]:
    """(dq, dk, dv) by torch autograd through the reference, in float64 unless dtype is given."""
    import torch

    dtype = dtype or torch.float64
    q, k, v = (torch.from_numpy(x).to(dtype).requires_grad_() for x in (p.q, p.k, p.v))
    out, lse = attention_ref_torch(spec, q, k, v, scale=p.scale, dtype=dtype, **params_as(p.params, torch.as_tensor))
    grads = torch.autograd.grad(
        [out, lse], [q, k, v], [torch.from_numpy(c.dout).to(dtype), torch.from_numpy(c.dlse).to(dtype)]
    )
    return [g.double().numpy() for g in grads]


GRAD_FLOOR = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 1e-2}


def assert_grads_exact(spec: Spec, p: Problem, c: Cotangents, grads) -> dict:
    """Kernel gradients against float64 autograd; fp16/bf16 by the 2x-framework rule."""
    import torch

    ref = reference_grads(spec, p, c)
    lowp = None if p.dtype == "float32" else reference_grads(spec, p, c, getattr(torch, p.dtype))
    errors = {}
    for i, (name, ours, exact) in enumerate(zip(("dq", "dk", "dv"), grads, ref)):
        ours = np.asarray(ours, dtype=np.float64)
        assert not np.isnan(ours).any(), f"NaN in {name}"
        magnitude = max(1.0, np.abs(exact).max(initial=0.0))
        err = np.abs(ours - exact).max(initial=0.0)
        if lowp is None:
            allowed = GRAD_FLOOR["float32"] * magnitude
        else:
            allowed = 2 * np.abs(lowp[i] - exact).max(initial=0.0) + GRAD_FLOOR[p.dtype] * magnitude
        assert err <= allowed, f"max |{name} - ref| = {err:.3g} > allowed {allowed:.3g}"
        errors[name] = float(err)
    return errors


def run_triton_grad(spec: Spec, p: Problem, c: Cotangents):
    import torch

    fix_interpreter_bf16_dot()
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
