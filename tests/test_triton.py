"""Generated Triton kernels (under TRITON_INTERPRET=1) against the float64 oracle: forward
outputs and LSE, and gradients through the torch custom op."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen.spec import load_spec
from tests import harness
from tests.strategies import shapes, spec_toml, specs

SPECS = sorted(Path(__file__).resolve().parent.parent.joinpath("specs").glob("*.toml"))
DRAWN = {
    "drawn": specs(),
    "shape": shapes(),
    "seed": st.integers(0, 2**32 - 1),
    "scale": st.sampled_from([None, 0.05, 0.3, -0.2]),  # negative: the forward flips q
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_spec_examples(spec_file, dtype):
    """Each spec in specs/, with its own block sizes, at lengths that leave tails."""
    spec = harness.with_dtype(load_spec(spec_file), dtype)
    p = harness.make_problem(
        spec, batch=1, heads=2, q_len=300, kv_len=277, seed=11, params=harness.example_params(spec.name, 1, 2, 300, 277)
    )
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))
    c = harness.make_cotangents(p, seed=11)
    harness.assert_grads_exact(spec, p, c, harness.run_triton_grad(spec, p, c))


@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_spec_examples_long_forward(spec_file, monkeypatch):
    """The forward's long-sequence tiles at a length the short-sequence ones would take (the
    bounds read the block sizes as kernel constants, so one kernel serves both)."""
    spec = harness.with_dtype(load_spec(spec_file), "float16")
    module = harness.load_target(spec, "triton_gpu")
    if not module.SHORT_KV_LEN:
        pytest.skip("this spec has one forward configuration, run by test_spec_examples")
    monkeypatch.setattr(module, "SHORT_KV_LEN", 0)
    p = harness.make_problem(
        spec, batch=1, heads=2, q_len=300, kv_len=277, seed=12, params=harness.example_params(spec.name, 1, 2, 300, 277)
    )
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))


@pytest.mark.parametrize("name", ["causal", "document", "value_dim", "sinks", "alibi_slopes", "relative_bias"])
def test_pointer_tiles_of_gpus_without_tma(name, monkeypatch):
    """On GPUs without TMA (sm80, AMD) the forward, dQ and dK/dV kernels move their tiles through
    pointers, not tensor descriptors: the same kernels, exact, with grouped kv heads."""
    spec = harness.with_dtype(load_spec(f"specs/{name}.toml"), "float16")
    module = harness.load_target(spec, "triton_gpu")
    monkeypatch.setattr(module, "_tma", lambda device: False)
    p = harness.make_problem(
        spec, 1, 4, 200, 177, seed=13, params=harness.example_params(spec.name, 1, 4, 200, 177), kv_heads=2
    )
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))
    c = harness.make_cotangents(p, seed=13)
    harness.assert_grads_exact(spec, p, c, harness.run_triton_grad(spec, p, c))


@settings(max_examples=40)
@given(**DRAWN)
def test_drawn_specs(drawn, shape, seed, scale):
    spec = harness.spec_from_text(drawn.text)
    p = harness.make_problem(spec, shape.batch, shape.heads, shape.q_len, shape.kv_len, seed, drawn.params, scale)
    harness.assert_exact(spec, p, *harness.run_triton(spec, p))


@settings(max_examples=7)
@given(**DRAWN)
def test_drawn_specs_gradients(drawn, shape, seed, scale):
    spec = harness.spec_from_text(drawn.text)
    p = harness.make_problem(spec, shape.batch, shape.heads, shape.q_len, shape.kv_len, seed, drawn.params, scale)
    c = harness.make_cotangents(p, seed)
    harness.assert_grads_exact(spec, p, c, harness.run_triton_grad(spec, p, c))


def test_rows_with_no_visible_key():
    """Rows that see nothing: output 0, LSE -inf, gradients 0, never NaN."""
    spec = harness.spec_from_text(spec_toml("kv_idx < w and kv_idx <= q_idx - 40"))
    p = harness.make_problem(spec, 1, 1, 100, 90, seed=5, params={"w": 30})
    out, lse = harness.run_triton(spec, p)
    assert (out[:, :, :40] == 0).all() and np.isneginf(lse[:, :, :40]).all()
    c = harness.make_cotangents(p, seed=5)
    dq, dk, dv = harness.run_triton_grad(spec, p, c)
    assert (dq[:, :, :40] == 0).all() and (dk[:, :, 30:] == 0).all() and (dv[:, :, 30:] == 0).all()
    harness.assert_grads_exact(spec, p, c, (dq, dk, dv))


def test_a_launch_is_keyed_by_what_tritons_binder_reads_of_its_arguments():
    """_launch reuses a compiled kernel for arguments whose _specialization is the same: that must
    hold exactly where Triton's own binder specializes them alike (ints by class, tensors by dtype
    and 16-byte alignment, descriptors by dtype, block shape and layout, tuples by their items), or a
    call would run a kernel compiled for other arguments."""
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.experimental.gluon import language as gl

    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    x = torch.empty(4, 16, 64, 128, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, 64, 128], gl.bfloat16)
    descriptor = lambda t, rows: module._NvmmaTileDescriptor(
        t, list(t.shape), list(t.stride()), [1, 1, rows, 128], module._nvmma_layout(rows, 128, t.dtype)
    )
    values = [
        *(1, 0, 2, 15, 16, 17, 32, -16, -5, 2**31 - 16, 2**31, 2**31 + 1, -(2**31), -(2**31) - 16, 2**62, 2**63 + 16),
        *(0.5, True, False, None),
        *(x, x[:, :, 1:], x.float(), torch.empty(3, dtype=torch.bfloat16)[1:], x.to(torch.float16)),
        *(descriptor(x, 64), descriptor(x[:, 1:], 64), descriptor(x, 128), descriptor(x.half(), 64)),
        module.TensorDescriptor.from_tensor(x, [1, 1, 64, 128]),
        *((x, 16, 1), (x, 16, 2), (x, 17, 1), (x[:, :, 1:], 16, 1), (x.float(), 16, 1), ((x, 1), 16), (), (None,)),
    ]
    assert layout == module._nvmma_layout(64, 128, torch.bfloat16)
    triton_key = lambda v: native_specialize_impl(BaseBackend, v, False, True, True)
    for a in values:
        for b in values:
            same = module._specialization((a,)) == module._specialization((b,))
            assert same == (triton_key(a) == triton_key(b)), (a if not hasattr(a, "shape") else a.shape, b)
    assert module._specialization((x, object())) is None  # anything else: Triton's own launch


def test_a_launch_binds_once_then_calls_the_compiled_kernel(monkeypatch):
    """The first launch of a kernel for some arguments goes through Triton (which compiles and
    launches it); later launches with arguments specialized alike call its launcher directly, with
    every argument in the kernel's order on the current stream; others go through Triton again."""
    import torch

    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    launched = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        def run(self, *args):
            launched.append(("direct", args))

        def launch_metadata(self, grid, stream, *args):
            return None

    class Kernel:
        arg_names = ("x", "n", "BLOCK")

        def __init__(self):
            self.used_global_vals = {("LIMIT", 0): (4, vars(module))}

        def __getitem__(self, grid):
            return lambda *args, **constants: launched.append(("triton", grid, args, constants)) or Compiled()

    monkeypatch.setattr(module, "_BIND_ONCE", True)
    monkeypatch.setattr(module, "_LAUNCHES", {})
    monkeypatch.setattr(module, "LIMIT", 4, raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)  # (CPU builds lack it)
    kernel, x = Kernel(), torch.zeros(8)
    module._launch(kernel, (2, 3), x, 32, BLOCK=16, num_warps=4)
    module._launch(kernel, (2, 3), x, 48, BLOCK=16, num_warps=4)  # 48: a multiple of 16 as well
    module._launch(kernel, (2, 3), x, 33, BLOCK=16, num_warps=4)  # another class of int
    monkeypatch.setattr(module, "LIMIT", 5)  # a global the kernel read changed: Triton's launch (which raises)
    module._launch(kernel, (2,), x, 48, BLOCK=16, num_warps=4)
    monkeypatch.setattr(module, "LIMIT", 4)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # traced: Triton's launch, which it knows
    module._launch(kernel, (2, 3), x, 48, BLOCK=16, num_warps=4)
    assert [entry[0] for entry in launched] == ["triton", "direct", "triton", "triton", "triton"]
    hooks = module.triton.knobs.runtime
    direct = (2, 3, 1, 77, "function", "metadata", None, hooks.launch_enter_hook, hooks.launch_exit_hook, x, 48, 16)
    assert launched[1][1] == direct


def test_eager_calls_on_one_stream_share_a_kept_buffer(monkeypatch):
    """_stream_buffer: one buffer per stream and name, grown when a call needs more; fresh ones under
    CUDA-graph capture (a graph may outlive it), past _KEPT_BYTES, and on the CPU."""
    import torch

    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    made = []
    new = lambda n, device, dtype: made.append(n) or torch.empty(n, dtype=dtype)  # (no GPU here)
    stream = ["first"]
    monkeypatch.setattr(module, "_KEPT", {})
    monkeypatch.setattr(module, "_stream_key", lambda device: stream[0] and (device, stream[0]))
    gpu = torch.device("cuda", 0)
    kept = module._stream_buffer(gpu, "parts", 10, new)
    assert module._stream_buffer(gpu, "parts", 1024, new) is kept and made == [1024]
    grown = module._stream_buffer(gpu, "parts", 3000, new)
    assert module._stream_buffer(gpu, "parts", 10, new) is grown and made == [1024, 3000]
    assert module._stream_buffer(gpu, "lse", 10, new) is not grown  # another name
    stream[0] = "second"
    assert module._stream_buffer(gpu, "parts", 10, new) is not grown  # another stream
    stream[0] = None  # capturing a CUDA graph
    assert module._stream_buffer(gpu, "parts", 10, new) is not module._stream_buffer(gpu, "parts", 10, new)
    stream[0] = "first"
    large = module._KEPT_BYTES // 4 + 1  # float32s
    assert module._stream_buffer(gpu, "parts", large, new) is not module._stream_buffer(gpu, "parts", large, new)
    assert module._stream_buffer(gpu, "parts", 10, new) is grown
    cpu = torch.device("cpu")
    assert module._stream_buffer(cpu, "parts", 10, new) is not module._stream_buffer(cpu, "parts", 10, new)
