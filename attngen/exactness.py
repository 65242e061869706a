"""The exactness rule: is a kernel's result as exact as attention in its precision can be?

Input: what a kernel computed (out [B, H, Lq, Dv] and lse [B, H, Lq], or the gradients dq, dk,
dv), the float64 reference on the same rounded inputs (attngen.reference), and, for fp16 and
bf16, a same-precision baseline: a plain implementation run in the kernel's dtype
(`lowp_baseline`, `reference_grads(dtype=...)`) or a framework kernel such as torch SDPA.
Output: a `Verdict` -- the errors measured, the bounds allowed, an ok flag and a message.

The rule, adapted from FlashAttention's test rule (Dao-AILab/flash-attention,
tests/test_flash_attn.py: a kernel's max error against an upcast reference must be at most twice
the error of a plain PyTorch implementation in the same precision), with a float64 reference and
a small floor added:

* fp32: max |ours - ref| <= FLOOR["float32"] for outputs, and
  GRAD_FLOOR["float32"] * max(1, max |ref|) for gradients.
* fp16, bf16: max |ours - ref| <= 2 * max |baseline - ref| + the same floors of the dtype.
* FP8 forward (e4m3 inputs, attention_fp8): the same, the baseline a plain FP8 forward
  (`attention_ref_torch(..., fp8_probs=True)` in float32: P rounded to e4m3 for P V, as
  FlashAttention-3's own test rounds it), the floor that of the bf16 output. The reference takes
  the inputs' true values (e4m3 times descale).
* LSE: within LSE_RTOL (1e-4; FP8 1e-3) * max(1, max |ref|) on rows that see a key; -inf exactly
  on the rows that see none, whose output must be exactly 0.
* A NaN in anything measured fails.

Every check of the package goes through `judge`: the CPU tests through `check_forward` and
`check_grads` (or their `assert_*` forms) on whole arrays; the GPU bench scripts and `attngen
tune` measure their errors themselves (on a slice of a large problem, against a peer kernel) and
pass the numbers to `judge`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from attngen.backends.base import FP8
from attngen.reference import attention_ref_torch, dense_mask, evaluate, kv_heads_expanded, positions
from attngen.spec import Spec

# Allowed absolute error of an output beyond twice the baseline's (outputs are averages of the
# values, so their scale is v's: unit normals in the tests and benches).
FLOOR = {"float32": 2e-5, "float16": 2e-4, "bfloat16": 2e-3, FP8: 2e-3}
# Allowed error of a gradient beyond twice the baseline's, in units of max(1, max |reference|).
GRAD_FLOOR = {"float32": 1e-4, "float16": 1e-3, "bfloat16": 1e-2}
# Allowed error of the LSE (computed in float32 whatever the dtype), in units of max(1, max |LSE|).
# FP8: Hopper's tensor cores add FP8 products keeping about 14 bits of mantissa (DeepSeek-V3's
# report), so q.k carries errors near 1e-4 of sum |q_i k_i|, which the LSE inherits.
LSE_RTOL = {"float32": 1e-4, "float16": 1e-4, "bfloat16": 1e-4, FP8: 1e-3}
GRADIENTS = ("dq", "dk", "dv")

_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


def is_gradient(name: str) -> bool:
    """Whether a judged quantity is a gradient: dq, dk, dv, or a param's (d + its name)."""
    return name in GRADIENTS or name.startswith("d")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What `judge` (and the checks built on it) found.

    Attributes:
        dtype: The kernel's dtype ("float32", "float16" or "bfloat16").
        errors: Max absolute error against the float64 reference, per quantity ("out", "lse",
            "dq", "dk", "dv").
        allowed: The bound each error was held to.
        baseline: The same-precision baseline's error per quantity (empty where none was used).
        problems: One line per failure; empty when the result is exact.
    """

    dtype: str
    errors: dict[str, float]
    allowed: dict[str, float]
    baseline: dict[str, float]
    problems: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.problems

    @property
    def failed(self) -> list[str]:
        """The quantities whose error is NaN or beyond its bound."""
        return [name for name, err in self.errors.items() if not err <= self.allowed[name]]

    @property
    def message(self) -> str:
        """The failures, or the errors and bounds of an exact result, on one line."""
        if self.problems:
            return "; ".join(self.problems)
        shown = ", ".join(f"{n} {e:.3g} <= {self.allowed[n]:.3g}" for n, e in self.errors.items())
        return f"exact ({self.dtype}): {shown}"

    def check(self) -> Verdict:
        """Raise AssertionError with the message unless ok; return self otherwise."""
        if not self.ok:
            raise AssertionError(self.message)
        return self


# ----------------------------------------------------------------------------- the rule


def allowed_error(name: str, dtype: str, baseline_error: float | None = None, magnitude: float = 1.0) -> float:
    """The largest error the rule accepts for one quantity.

    Args:
        name: "lse", a gradient ("dq", "dk", "dv", or "d" and a param's name: "dsinks"), or an
            output (any other name, e.g. "out").
        dtype: The kernel's dtype.
        baseline_error: Max |baseline - reference| of the same-precision baseline; needed for
            fp16 and bf16 outputs and gradients, unused for fp32 and for the LSE.
        magnitude: Max |reference| of the quantity (gradients and LSE are judged relative to
            max(1, magnitude)).

    Returns:
        The bound.

    Raises:
        ValueError: An unknown dtype, or no baseline error where the rule needs one.
    """
    if dtype not in FLOOR:
        raise ValueError(f"no exactness rule for dtype {dtype!r} (known: {', '.join(FLOOR)})")
    if is_gradient(name) and dtype not in GRAD_FLOOR:
        raise ValueError(f"no gradient rule for {dtype}: its kernels are forward only")
    if name == "lse":
        return LSE_RTOL[dtype] * max(1.0, magnitude)
    floor = GRAD_FLOOR[dtype] * max(1.0, magnitude) if is_gradient(name) else FLOOR[dtype]
    if dtype == "float32":
        return floor
    if baseline_error is None:
        raise ValueError(f"{dtype} {name}: the rule needs the error of a same-precision baseline")
    return 2 * baseline_error + floor


def judge(
    dtype: str,
    errors: Mapping[str, float],
    baseline: Mapping[str, float] | None = None,
    magnitudes: Mapping[str, float] | None = None,
) -> Verdict:
    """Judge measured max errors by the rule (see the module docstring).

    Args:
        dtype: The kernel's dtype.
        errors: Max |ours - reference| per quantity ("out", "lse", "dq", "dk", "dv").
        baseline: Max |baseline - reference| per quantity, for fp16 and bf16 (not for "lse").
        magnitudes: Max |reference| per quantity; missing ones count as 1.

    Returns:
        The verdict; a NaN error fails.
    """
    baseline, magnitudes = dict(baseline or {}), dict(magnitudes or {})
    allowed = {name: allowed_error(name, dtype, baseline.get(name), magnitudes.get(name, 1.0)) for name in errors}
    problems = []
    for name, err in errors.items():
        if np.isnan(err):
            problems.append(f"NaN in {name}")
        elif not err <= allowed[name]:
            problems.append(f"max |{name} - ref| = {err:.3g} > allowed {allowed[name]:.3g}")
    used = {} if dtype == "float32" else {n: float(baseline[n]) for n in errors if n in baseline and n != "lse"}
    return Verdict(dtype, {n: float(e) for n, e in errors.items()}, allowed, used, tuple(problems))


def check_forward(dtype: str, out, lse, ref_out, ref_lse, baseline_out=None) -> Verdict:
    """Judge a kernel's (out, lse) against the float64 reference.

    Args:
        dtype: The kernel's dtype.
        out: [B, H, Lq, Dv] output (numpy, or torch on any device; compared in float64).
        lse: [B, H, Lq] log-sum-exp of the scaled scores.
        ref_out: The float64 reference's output on the same rounded inputs.
        ref_lse: The float64 reference's LSE (-inf on rows that see no key).
        baseline_out: The same-precision baseline's output; needed for fp16 and bf16.

    Returns:
        The verdict on out and lse, including that rows with no visible key give LSE -inf and
        output exactly 0.
    """
    out, lse, ref_out, ref_lse = (_float64(x) for x in (out, lse, ref_out, ref_lse))
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape:
        shapes = f"out {out.shape}, lse {lse.shape}; reference {ref_out.shape}, {ref_lse.shape}"
        return Verdict(dtype, {}, {}, {}, (f"shapes differ: {shapes}",))
    empty = np.isneginf(ref_lse)
    errors = {"out": max_error(out, ref_out), "lse": max_error(lse[~empty], ref_lse[~empty])}
    magnitudes = {"out": _max_abs(ref_out), "lse": _max_abs(ref_lse[~empty])}
    baseline = None
    if baseline_out is not None and dtype != "float32":
        baseline = {"out": max_error(_float64(baseline_out), ref_out)}
    verdict = judge(dtype, errors, baseline, magnitudes)
    problems = list(verdict.problems)
    if not np.array_equal(np.isneginf(lse), empty):
        problems.append("lse is not -inf exactly where a row sees no key")
    if not (out[empty] == 0).all():
        problems.append("rows with no visible key must give 0")
    return dataclasses.replace(verdict, problems=tuple(problems))


def check_grads(dtype: str, grads, ref_grads, baseline_grads=None) -> Verdict:
    """Judge a kernel's gradients against float64 autograd through the reference.

    Args:
        dtype: The kernel's dtype.
        grads: (dq, dk, dv), or a mapping from names to arrays (numpy, or torch on any device).
        ref_grads: The float64 reference's gradients, in the same form.
        baseline_grads: The same-precision baseline's gradients; needed for fp16 and bf16.

    Returns:
        The verdict on each gradient.
    """
    grads, ref_grads = _named(grads), _named(ref_grads)
    problems = [
        f"{name} shape {np.shape(grads[name])} != reference {np.shape(ref_grads[name])}"
        for name in ref_grads
        if np.shape(grads[name]) != np.shape(ref_grads[name])
    ]
    if problems:
        return Verdict(dtype, {}, {}, {}, tuple(problems))
    ref_grads = {name: _float64(x) for name, x in ref_grads.items()}
    errors = {name: max_error(_float64(grads[name]), ref) for name, ref in ref_grads.items()}
    magnitudes = {name: _max_abs(ref) for name, ref in ref_grads.items()}
    baseline = None
    if baseline_grads is not None and dtype != "float32":
        baseline = {name: max_error(_float64(x), ref_grads[name]) for name, x in _named(baseline_grads).items()}
    return judge(dtype, errors, baseline, magnitudes)


def assert_forward(dtype: str, out, lse, ref_out, ref_lse, baseline_out=None) -> Verdict:
    """`check_forward`, raising AssertionError with its message unless the result is exact."""
    return check_forward(dtype, out, lse, ref_out, ref_lse, baseline_out).check()


def assert_grads(dtype: str, grads, ref_grads, baseline_grads=None) -> Verdict:
    """`check_grads`, raising AssertionError with its message unless the gradients are exact."""
    return check_grads(dtype, grads, ref_grads, baseline_grads).check()


def max_error(ours, ref) -> float:
    """max |ours - ref| as a float (0 for empty arrays; NaN if either holds a NaN)."""
    diff = np.abs(_float64(ours) - _float64(ref))
    return float(np.nan) if np.isnan(diff).any() else float(diff.max(initial=0.0))


# ----------------------------------------------------------------------------- inputs and baselines


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded (to nearest even) to dtype, returned as float32.

    Args:
        x: Any float array.
        dtype: "float32", "float16" or "bfloat16".

    Returns:
        A float32 array holding values exactly representable in dtype.
    """
    if dtype == "bfloat16":
        bits = np.asarray(x, dtype=np.float32).view(np.uint32)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return rounded.astype(np.uint32).view(np.float32)
    return np.asarray(x).astype(_NUMPY_DTYPES[dtype]).astype(np.float32)


def lowp_baseline(spec: Spec, q, k, v, dtype: str, *, scale: float | None = None, params=None) -> np.ndarray:
    """The output of a plain implementation in dtype: what a framework would compute.

    Scores come from a float32 matmul of the rounded inputs (as torch's bf16/fp16 matmuls
    accumulate in fp32), are rounded to the dtype, and so are the probabilities and the output.

    Args:
        spec: The spec (its mask and score expression).
        q: [B, H, Lq, D] float32 holding dtype values; k, v: [B, H_kv, Lk, D] likewise.
        k: See q.
        v: See q.
        dtype: The precision to imitate.
        scale: The score scale (default 1 / sqrt(D)).
        params: The spec's runtime params (numpy arrays for tensors).

    Returns:
        [B, H, Lq, Dv] float64.
    """
    params = params or {}
    q, k, v = (np.asarray(x, dtype=np.float32) for x in (q, k, v))
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    scale = scale if scale is not None else 1.0 / np.sqrt(head_dim)
    k, v = (kv_heads_expanded(x, heads) for x in (k, v))
    score = round_to(np.matmul(q, k.swapaxes(-1, -2)) * np.float32(scale), dtype).astype(np.float64)
    if spec.score is not None:
        env = {"score": score, **positions(batch, heads, q_len, kv_len), **params}
        score = np.broadcast_to(evaluate(spec.score, env), score.shape)
    score = np.where(dense_mask(spec, batch, heads, q_len, kv_len, params), score, -np.inf)
    row_max = score.max(axis=-1, keepdims=True, initial=-np.inf)
    probs = np.exp(score - np.where(np.isfinite(row_max), row_max, 0.0))
    total = probs.sum(axis=-1, keepdims=True)
    probs = round_to((probs / np.where(total == 0, 1.0, total)).astype(np.float32), dtype)
    return round_to(np.matmul(probs, v), dtype).astype(np.float64)


def reference_grads(
    spec: Spec, q, k, v, dout, dlse=None, *, dtype: str = "float64", scale: float | None = None, params=None
) -> list[np.ndarray]:
    """(dq, dk, dv) by torch autograd through the reference (attention_ref_torch).

    In float64 this is the reference the gradients are judged against; in a kernel's dtype it is
    the gradients' same-precision baseline.

    Args:
        spec: The spec.
        q: [B, H, Lq, D] numpy array (the rounded inputs); k, v: [B, H_kv, Lk, D].
        k: See q.
        v: See q.
        dout: [B, H, Lq, Dv] cotangent of the output.
        dlse: [B, H, Lq] cotangent of the LSE, or None for none.
        dtype: The precision of every step ("float64", or a kernel's dtype).
        scale: The score scale (default 1 / sqrt(D)).
        params: The spec's runtime params (numpy arrays for tensors).

    Returns:
        [dq, dk, dv] as float64 numpy arrays.
    """
    import torch

    torch_dtype = getattr(torch, dtype)
    tensors = {name: torch.as_tensor(x) if isinstance(x, np.ndarray) else x for name, x in (params or {}).items()}
    q, k, v = (torch.from_numpy(np.asarray(x)).to(torch_dtype).requires_grad_() for x in (q, k, v))
    out, lse = attention_ref_torch(spec, q, k, v, scale=scale, dtype=torch_dtype, **tensors)
    outputs, cotangents = [out], [torch.from_numpy(np.asarray(dout)).to(torch_dtype)]
    if dlse is not None:
        outputs.append(lse)
        cotangents.append(torch.from_numpy(np.asarray(dlse)).to(torch_dtype))
    grads = torch.autograd.grad(outputs, [q, k, v], cotangents)
    return [g.double().numpy() for g in grads]


# ----------------------------------------------------------------------------- helpers


def _float64(x) -> np.ndarray:
    """x as a float64 numpy array; torch tensors (any device, any dtype) are copied to the host."""
    if hasattr(x, "detach"):  # a torch tensor; numpy has no such method
        return x.detach().double().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _max_abs(x: np.ndarray) -> float:
    """max |x| over the finite entries (0 for none)."""
    x = np.abs(x)
    return float(x[np.isfinite(x)].max(initial=0.0))


def _named(grads) -> dict:
    """(dq, dk, dv) or a mapping of them, as a dict by name."""
    if isinstance(grads, Mapping):
        return dict(grads)
    if isinstance(grads, Sequence) and len(grads) == len(GRADIENTS):
        return dict(zip(GRADIENTS, grads))
    raise TypeError("gradients must be (dq, dk, dv) or a mapping from their names")
