"""attngen.exactness: the one exactness rule, on hand-made results (no kernel runs).

A correct fp16/bf16 result passes and one beyond the bound fails, fp32 is held to its floor
whatever the baseline, rows with no visible key need LSE -inf and output 0, NaN fails; and no
other module of attngen/, bench/ or tests/ keeps a tolerance table or a baseline of its own.
"""

import ast
from pathlib import Path

import numpy as np
import pytest

from attngen import exactness
from attngen.reference import attention_ref
from attngen.spec import parse_spec
from tests.strategies import spec_toml

ROOT = Path(__file__).resolve().parent.parent
LOWP = ["float16", "bfloat16"]


def problem(dtype: str, mask=None, q_len=24, kv_len=20, seed=0):
    """A spec, its rounded inputs, the float64 reference and the same-precision baseline."""
    spec = parse_spec(spec_toml(mask, head_dim=16, extra=(f'dtype = "{dtype}"',)), "<test>")
    rng = np.random.default_rng(seed)
    q, k, v = (
        exactness.round_to(rng.standard_normal((1, 2, n, 16)).astype(np.float32), dtype)
        for n in (q_len, kv_len, kv_len)
    )
    ref_out, ref_lse = attention_ref(spec, q, k, v)
    baseline = exactness.lowp_baseline(spec, q, k, v, dtype)
    return spec, (q, k, v), ref_out, ref_lse, baseline


def as_kernel(ref_out, ref_lse, dtype):
    """What an ideal kernel returns: the exact output rounded to the dtype, the LSE in float32."""
    return exactness.round_to(ref_out, dtype), ref_lse.astype(np.float32)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", LOWP)
def test_correct_low_precision_result_passes(dtype):
    _, _, ref_out, ref_lse, baseline = problem(dtype, "causal")
    out, lse = as_kernel(ref_out, ref_lse, dtype)
    verdict = exactness.check_forward(dtype, out, lse, ref_out, ref_lse, baseline)
    assert verdict.ok, verdict.message
    assert (
        verdict.baseline["out"] > 0 and verdict.allowed["out"] == 2 * verdict.baseline["out"] + exactness.FLOOR[dtype]
    )
    # The baseline itself is within the bound (its error is half of it, floor aside).
    assert exactness.check_forward(dtype, baseline, lse, ref_out, ref_lse, baseline).ok


@pytest.mark.parametrize("dtype", LOWP)
def test_result_beyond_the_bound_fails(dtype):
    _, _, ref_out, ref_lse, baseline = problem(dtype, "causal")
    allowed = exactness.check_forward(dtype, *as_kernel(ref_out, ref_lse, dtype), ref_out, ref_lse, baseline).allowed
    for factor, ok in ((0.9, True), (1.1, False)):
        out = ref_out.copy()
        out[0, 1, 5, 3] += factor * allowed["out"]
        verdict = exactness.check_forward(dtype, out, ref_lse, ref_out, ref_lse, baseline)
        assert verdict.ok == ok, verdict.message
    assert verdict.failed == ["out"] and "max |out - ref|" in verdict.message
    with pytest.raises(AssertionError, match="out"):
        exactness.assert_forward(dtype, out, ref_lse, ref_out, ref_lse, baseline)
    lse = ref_lse.copy()
    lse[0, 0, 7] += 2 * allowed["lse"]
    assert exactness.check_forward(dtype, ref_out, lse, ref_out, ref_lse, baseline).failed == ["lse"]


def test_fp32_is_held_to_its_floor_whatever_the_baseline():
    _, _, ref_out, ref_lse, _ = problem("float32")
    sloppy = ref_out + 1e-2  # a baseline this far off must not loosen the bound
    for error, ok in ((0.5 * exactness.FLOOR["float32"], True), (1.5 * exactness.FLOOR["float32"], False)):
        out = ref_out.copy()
        out[0, 0, 0, 0] += error
        verdict = exactness.check_forward("float32", out, ref_lse, ref_out, ref_lse, sloppy)
        assert verdict.ok == ok and verdict.allowed["out"] == exactness.FLOOR["float32"], verdict.message
    assert verdict.baseline == {}


def test_rows_with_no_visible_key():
    """Rows 0-2 see no key: LSE -inf and output exactly 0, nothing else."""
    _, _, ref_out, ref_lse, baseline = problem("bfloat16", "q_idx >= kv_idx + 3")
    empty = np.isneginf(ref_lse)
    assert empty[..., :3].all() and not empty[..., 3:].any() and (ref_out[empty] == 0).all()
    out, lse = as_kernel(ref_out, ref_lse, "bfloat16")
    verdict = exactness.check_forward("bfloat16", out, lse, ref_out, ref_lse, baseline)
    assert verdict.ok and np.isfinite(verdict.errors["lse"]), verdict.message

    finite = lse.copy()
    finite[0, 0, 1] = 0.0
    message = exactness.check_forward("bfloat16", out, finite, ref_out, ref_lse, baseline).message
    assert "-inf exactly where a row sees no key" in message
    nonzero = out.copy()
    nonzero[0, 1, 2, 0] = 1e-30  # far below the bound, still not 0
    assert "must give 0" in exactness.check_forward("bfloat16", nonzero, lse, ref_out, ref_lse, baseline).message
    nan_lse = lse.copy()
    nan_lse[0, 0, 0] = np.nan
    assert not exactness.check_forward("bfloat16", out, nan_lse, ref_out, ref_lse, baseline).ok


@pytest.mark.parametrize("dtype", ["float32", *LOWP])
def test_nan_fails(dtype):
    _, _, ref_out, ref_lse, baseline = problem(dtype)
    out, lse = as_kernel(ref_out, ref_lse, dtype)
    out[0, 0, 3, 2] = np.nan
    verdict = exactness.check_forward(dtype, out, lse, ref_out, ref_lse, baseline)
    assert not verdict.ok and "NaN in out" in verdict.message
    out, lse = as_kernel(ref_out, ref_lse, dtype)
    lse[0, 1, 4] = np.nan
    assert "NaN in lse" in exactness.check_forward(dtype, out, lse, ref_out, ref_lse, baseline).message
    assert not exactness.judge(dtype, {"dq": float("nan")}, {"dq": 0.1}).ok


def test_shapes_must_match():
    _, _, ref_out, ref_lse, _ = problem("float32")
    assert "shapes differ" in exactness.check_forward("float32", ref_out[:, :1], ref_lse, ref_out, ref_lse).message


def test_low_precision_needs_a_baseline_and_a_known_dtype():
    with pytest.raises(ValueError, match="baseline"):
        exactness.judge("float16", {"out": 0.0})
    with pytest.raises(ValueError, match="dtype"):
        exactness.judge("float8", {"out": 0.0})
    assert exactness.judge("float16", {"lse": 0.0}).ok  # the LSE needs no baseline


def test_torch_tensors_are_accepted():
    torch = pytest.importorskip("torch")
    _, _, ref_out, ref_lse, baseline = problem("bfloat16", "causal")
    out = torch.from_numpy(ref_out).to(torch.bfloat16)
    verdict = exactness.check_forward("bfloat16", out, torch.from_numpy(ref_lse).float(), ref_out, ref_lse, baseline)
    assert verdict.ok, verdict.message


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("dtype", ["float32", *LOWP])
def test_gradients(dtype):
    spec, (q, k, v), _, _, _ = problem(dtype, "causal", seed=1)
    rng = np.random.default_rng(2)
    dout = exactness.round_to(rng.standard_normal((1, 2, 24, 16)).astype(np.float32), dtype)
    dlse = rng.standard_normal((1, 2, 24)).astype(np.float32)
    ref = exactness.reference_grads(spec, q, k, v, dout, dlse)
    lowp = None if dtype == "float32" else exactness.reference_grads(spec, q, k, v, dout, dlse, dtype=dtype)
    ours = [exactness.round_to(g, dtype) for g in ref]  # an ideal kernel's gradients
    verdict = exactness.assert_grads(dtype, ours, ref, lowp)
    assert set(verdict.errors) == {"dq", "dk", "dv"}
    for name, ref_g in zip(exactness.GRADIENTS, ref):
        magnitude = max(1.0, float(np.abs(ref_g).max()))
        floor = exactness.GRAD_FLOOR[dtype] * magnitude
        expected = floor if lowp is None else 2 * verdict.baseline[name] + floor
        assert verdict.allowed[name] == pytest.approx(expected)
    dk = ref[1].copy()
    dk[0, 0, 0, 0] += 1.1 * verdict.allowed["dk"]
    assert exactness.check_grads(dtype, (ref[0], dk, ref[2]), ref, lowp).failed == ["dk"]
    dv = ref[2].copy()
    dv[0, 1, 0, 0] = np.nan
    assert "NaN in dv" in exactness.check_grads(dtype, {"dq": ref[0], "dk": ref[1], "dv": dv}, ref, lowp).message


# ----------------------------------------------------------------------------- one owner


def _python_files():
    for folder in ("attngen", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != ROOT / "attngen" / "exactness.py":
                yield path


def _assigned_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    else:
        return []
    return [name.id for t in targets for name in ast.walk(t) if isinstance(name, ast.Name)]


def test_no_other_module_keeps_its_own_tolerances_or_baseline():
    """Floor tables (constants named *FLOOR*), round_to and the low-precision baseline are
    attngen.exactness's alone: other modules import them."""
    found = []
    for path in _python_files():
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            found += [f"{where}:{node.lineno} {name} =" for name in _assigned_names(node) if "FLOOR" in name]
            defined = node.name if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else ""
            if defined == "round_to" or "lowp_baseline" in defined:
                found.append(f"{where}:{node.lineno} def {defined}")
    assert not found, "tolerances or baselines outside attngen/exactness.py: " + ", ".join(found)


def test_bench_does_not_import_tests():
    for path in sorted((ROOT / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            modules += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(m == "tests" or m.startswith("tests.") for m in modules), f"{path.name} imports {modules}"
