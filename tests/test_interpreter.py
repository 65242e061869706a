"""A generated bf16 Triton module under Triton's interpreter is exact on its own: it fixes the
interpreter's bf16 bugs (triton-lang/triton#11584: bf16 bits handed to numpy; a float32 converted
to bf16 truncated, not rounded) when it is imported, in a process where neither attngen nor the
tests have touched the interpreter."""

import os
import subprocess
import sys

import numpy as np
import torch
import triton
import triton.language as tl

from attngen.build import write_package
from attngen.exactness import assert_forward, lowp_baseline, round_to
from attngen.reference import attention_ref
from attngen.spec import load_spec, with_config
from tests import harness

# Runs the module as a user's script would: imported by path, attngen not imported; reads q, k, v
# from one file and writes out, lse to another.
_USER_SCRIPT = """
import importlib.util, sys
import numpy as np, torch
path, inputs, outputs = sys.argv[1:]
spec = importlib.util.spec_from_file_location("causal_triton_gpu", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert not any(name.startswith("attngen") for name in sys.modules), "the module imported attngen"
q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in np.load(inputs).values())
out, lse = module.attention(q, k, v, return_lse=True)
np.savez(outputs, out=out.float().numpy(), lse=lse.numpy())
"""


def test_a_bf16_module_is_exact_under_the_interpreter_by_itself(tmp_path):
    spec = load_spec("specs/causal.toml")
    assert spec.dtype == "bfloat16"
    spec = with_config(spec, "triton_gpu", block_m=16, block_n=16, short_kv_len=0)  # a short interpreter run
    write_package(spec, tmp_path)
    rng = np.random.default_rng(0)
    q, k, v = (round_to(rng.standard_normal((1, 2, 40, spec.head_dim)).astype(np.float32), "bfloat16") for _ in "qkv")
    inputs, outputs = tmp_path / "qkv.npz", tmp_path / "out.npz"
    np.savez(inputs, q=q, k=k, v=v)
    result = subprocess.run(
        [sys.executable, "-c", _USER_SCRIPT, str(tmp_path / spec.name / "triton_gpu.py"), str(inputs), str(outputs)],
        capture_output=True,
        text=True,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ours = np.load(outputs)
    ref_out, ref_lse = attention_ref(spec, q, k, v)
    baseline = lowp_baseline(spec, q, k, v, "bfloat16")
    assert_forward("bfloat16", ours["out"], ours["lse"], ref_out, ref_lse, baseline)


@triton.jit
def _to_bf16(X, Y, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(Y + offsets, tl.load(X + offsets).to(tl.bfloat16))


def test_float32_to_bf16_rounds_to_the_nearest_even_as_the_gpu_does():
    """The interpreter dropped a float32's low bits in its conversion to bf16 (P and the outputs of
    the kernels), an ulp off where the GPU rounds: with the fix, the bits torch's rounding gives."""
    harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")  # a bf16 module: the fix is in
    one = 1.0
    ties = [one + 2**-8, one + 3 * 2**-8, -(one + 2**-8), 2.0 + 2**-7]  # halfway: to even (down, up, down, down)
    edges = [3.4e38, -3.4e38, 1e-40, -0.0, float("inf"), float("-inf"), float("nan"), one + 2**-8 + 2**-20]
    x = torch.cat(
        [
            torch.tensor(ties + edges),
            torch.randn(4096 - len(ties) - len(edges), generator=torch.Generator().manual_seed(0)) * 100,
        ]
    )
    y = torch.empty(4096, dtype=torch.bfloat16)
    _to_bf16[(1,)](x, y, N=4096)
    expected = x.to(torch.bfloat16)
    assert torch.equal(y.isnan(), expected.isnan())
    same = y.view(torch.int16) == expected.view(torch.int16)
    assert bool(same[~expected.isnan()].all()), x[~same & ~expected.isnan()][:8]
