"""The Hopper kernels (Gluon, sm90): the forward, the dQ and dK/dV kernels, the fused backward. Triton's interpreter cannot
run Gluon, so on a CPU they are compiled for sm_90a and their structure read from the PTX;
tests/test_gpu.py proves them exact on an H200. Their config keys are checked like the others."""

import json

import pytest

from attngen.errors import SpecError
from attngen.spec import load_spec, packed, parse_spec, retarget, with_config
from tests import harness

# Compiles one Hopper kernel of a module in a process of its own (TRITON_INTERPRET must be off when
# triton is imported) and prints what the PTX holds.
_INSPECT = """
import json, re, sys
from pathlib import Path
from attngen.backends.triton_gpu import TRITON_GPU
from attngen.build import import_generated
from attngen.check.gpu import _resource_usage, compile_kernel
module = import_generated(Path(sys.argv[1]), "_attngen_sm90_structure")
walk = json.loads(sys.argv[4])  # PERSISTENT and DYNAMIC, where not the module's
compiled = compile_kernel(module, TRITON_GPU.kernel(sys.argv[3]), sys.argv[2], 90, **walk)
ptx = compiled.asm["ptx"]
print(json.dumps({
    "stack_bytes": _resource_usage(compiled.asm["cubin"])["stack_bytes"],  # ptxas's spills
    "wgmma": ptx.count("wgmma.mma_async"),
    "waits": sorted(set(re.findall(r"wgmma.wait_group.sync.aligned\\s+(\\d+)", ptx))),
    "tma_loads": ptx.count("cp.async.bulk.tensor.4d.shared::cluster.global"),
    "registers": sorted({int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)}),
    "local": ptx.count("ld.local") + ptx.count("st.local"),
    "atomics": ptx.count("atom.global"),
    "tma_reductions": ptx.count("cp.reduce.async.bulk.tensor"),
}))
"""

HOPPER_KERNELS = (
    "fwd_sm90",
    "bwd_dq_sm90",
    "bwd_dkdv_sm90",
    "bwd_fused_sm90",
)  # each persistent by default: it walks tiles


@pytest.mark.parametrize(
    ("name", "kernel", "walk", "head_dim"),
    [
        *((name, kernel, {}, None) for kernel in HOPPER_KERNELS for name in ("causal", "document")),
        ("full", "fwd_sm90", {}, None),  # the persistent forward, a static share of the tiles per program
        *(("causal", kernel, {"PERSISTENT": 0, "DYNAMIC": 0}, None) for kernel in HOPPER_KERNELS),  # a program per tile
        # Heads wider than 128 (value_dim's 192) and of 256: the dK/dV kernel holds 64 keys a program and the
        # dQ kernel 64 queries, their consumers splitting the columns of dK and dV, or of dQ.
        ("value_dim", "bwd_dkdv_sm90", {}, None),
        *(("causal", kernel, {}, 256) for kernel in ("bwd_dq_sm90", "bwd_dkdv_sm90")),
    ],
)  # closed-form tile bounds; block tables
def test_the_hopper_kernels_compile_to_fa3s_structure(name, kernel, walk, head_dim):
    hopper = {"sm90_forward": 1, "sm90_backward": 1, "sm90_fused_backward": int(kernel == "bwd_fused_sm90")}
    spec = with_config(load_spec(f"specs/{name}.toml"), "triton_gpu", **hopper)
    spec = retarget(spec, head_dim, spec.dtype) if head_dim else spec
    module = harness.load_target(spec, "triton_gpu")
    ptx = harness.compiled_structure(_INSPECT, module.__file__, spec.dtype, kernel, json.dumps(walk))[-1]
    assert ptx["wgmma"] > 0 and ptx["tma_loads"] > 0  # asynchronous MMA fed by TMA
    # One product waited for alone while another is in flight: the softmax of the next kv block
    # under P V (forward), P under dP (dQ), P^T under dP^T (dK/dV).
    assert ptx["waits"] == ["0", "1"]
    assert {24, 240} <= set(ptx["registers"])  # registers moved from the loader warp to the consumers
    assert ptx["local"] == 0  # nothing in local memory at the PTX level
    # One atomic add a tile taken from the counter (the default where tiles differ in cost), and the
    # exchange of the launch's last take that leaves it zero for the next launch.
    dynamic = walk.get("DYNAMIC", module.SM90_DYNAMIC)
    assert ptx["atomics"] == (2 if dynamic else 0)
    # The fused backward adds each step's dQ to the float32 sums with a TMA reduction (one in each
    # consumer's loop over each run of q blocks); no other kernel reduces.
    assert (ptx["tma_reductions"] > 0) == (kernel == "bwd_fused_sm90")


@pytest.mark.parametrize("name", ["full", "causal"])
def test_the_hopper_forward_of_192_queries_has_three_consumers(name):
    """sm90_block_m = 192, FlashAttention-3's tiles at heads of 64: three consumer warpgroups of 64
    queries, 160 registers each (the loader keeps 24), and nothing spilled. (P leaves float32 as soon
    as its softmax is done: held across the next Q K^T, it took a consumer past 200 registers. A
    mask that reads tensors, document's, still spills there: make_config keeps 192 to plain
    attention.)"""
    spec = with_config(retarget(load_spec(f"specs/{name}.toml"), 64, "bfloat16"), "triton_gpu", sm90_block_m=192)
    module = harness.load_target(spec, "triton_gpu")
    ptx = harness.compiled_structure(_INSPECT, module.__file__, spec.dtype, "fwd_sm90", "{}")[-1]
    assert ptx["wgmma"] > 0 and ptx["tma_loads"] > 0 and ptx["waits"] == ["0", "1"]
    assert {24, 160} <= set(ptx["registers"]) and 240 not in ptx["registers"]
    assert ptx["local"] == 0 and ptx["stack_bytes"] == 0


def test_the_hopper_kernels_take_tiles_from_a_counter_where_they_differ_in_cost():
    """The Hopper kernels have a program per SM everywhere: each walks a static share of the tiles
    where every tile walks the same blocks, and takes its next tile from an atomic counter, heaviest
    first, where they differ (by block, batch, head or a block table)."""

    def dynamic(name):
        source = _source(load_spec(f"specs/{name}.toml"))
        assert "\nSM90_PERSISTENT = 1\n" in source
        return "\nSM90_DYNAMIC = 1\n" in source

    assert not dynamic("full") and not dynamic("relative_bias")
    assert all(map(dynamic, ("causal", "sliding_window", "prefix_lm_batched", "document")))


def test_the_hopper_kernels_are_built_where_they_are_measured_faster():
    def enabled(head_dim, dtype):
        spec = retarget(load_spec("specs/causal.toml"), head_dim, dtype)
        config, source = spec.config("triton_gpu"), _source(spec)
        backward = {"_attention_bwd_dq_sm90": config.sm90_dq, "_attention_bwd_dkdv_sm90": config.sm90_backward}
        assert all((name in source) == bool(on) for name, on in backward.items())
        assert ("_attention_fwd_sm90" in source) == bool(config.sm90_forward or config.sm90_fp8)  # (FP8's kernel too)
        assert ("def _attention_bwd_delta" in source) == bool(config.sm90_fused_backward)
        return config.sm90_forward, *backward.values(), config.sm90_fused_backward

    assert enabled(128, "bfloat16") == enabled(128, "float16") == (1, 1, 1, 1)
    assert enabled(64, "bfloat16") == (1, 1, 1, 0)
    # The fused backward serves plain attention and the causal mask at heads of 65-128 (where it was
    # measured faster); the bottom-right causal mask, not measured, keeps the two kernels.
    fused = {
        (name, head_dim): retarget(load_spec(f"specs/{name}.toml"), head_dim, "bfloat16")
        .config("triton_gpu")
        .sm90_fused_backward
        for name in ("full", "causal", "causal_bottom_right", "softcap")
        for head_dim in (64, 96, 128)
    }
    on = {(name, head_dim): 1 for name in ("full", "causal") for head_dim in (96, 128)}
    assert fused == {**dict.fromkeys(fused, 0), **on}
    # It serves calls of more than 2048 queries (1.04x the two kernels at 4k, 0.95-0.97x at 1k).
    assert load_spec("specs/full.toml").config("triton_gpu").sm90_fused_min_queries == 2048
    # Three consumers (192 queries a program) for plain attention at heads of 64, two elsewhere.
    rows = {
        (name, head_dim): retarget(load_spec(f"specs/{name}.toml"), head_dim, "bfloat16")
        .config("triton_gpu")
        .sm90_block_m
        for name in ("full", "causal", "softcap")
        for head_dim in (64, 128)
    }
    assert rows == {**dict.fromkeys(rows, 128), ("full", 64): 192}
    assert enabled(32, "bfloat16") == (0, 0, 0, 0)  # not measured
    assert enabled(128, "float32") == (0, 0, 0, 0)  # wgmma takes no float32 inputs
    # Heads of 256: the dQ kernel's Q, dO and O of 128 queries beside its K/V ring, and the dK/dV
    # kernel's K and V of 128 keys beside its Q/dO ring, would pass sm90's shared memory (the launch
    # would fail): there they hold 64, their two consumers splitting the columns. The fused backward's
    # consumers hold 64 keys each: not there.
    assert enabled(256, "bfloat16") == (1, 1, 1, 0)
    config = retarget(load_spec("specs/causal.toml"), 256, "bfloat16").config("triton_gpu")
    assert (config.sm90_dq_block_m, config.sm90_dkdv_block_n, config.sm90_block_n) == (64, 64, 64)
    text = 'name = "s"\nhead_dim = 256\ndtype = "bfloat16"\n[triton]\nsm90_backward = 1\nsm90_dkdv_block_n = 128\n'
    with pytest.raises(SpecError, match="the Hopper dK/dV kernel's tiles need more than sm90's 227 KiB"):
        parse_spec(text, "s.toml")
    # A score that reads a tensor at each (query, key) pair, a full bias, runs faster on the Triton
    # kernels (they pipeline its tiles); a relative table, read by distance, on the Hopper ones.
    bias, relative = (load_spec(f"specs/{name}.toml").config("triton_gpu") for name in ("bias", "relative_bias"))
    assert (bias.sm90_forward, bias.sm90_backward, bias.sm90_dq, bias.sm90_fused_backward) == (0, 0, 0, 0)
    hopper = ("sm90_forward", "sm90_backward", "sm90_dq", "sm90_fused_backward")
    assert [getattr(relative, key) for key in hopper] == [1, 1, 1, 0]
    # A spec opts in (or out) where it can run.
    for head_dim in (64, 128):
        text = f'name = "s"\nhead_dim = {head_dim}\ndtype = "bfloat16"\n[triton]\nsm90_fused_backward = 1\n'
        assert parse_spec(text, "s.toml").config("triton_gpu").sm90_fused_backward == 1


def test_calls_of_short_programs_take_the_triton_forward():
    """sm90_forward_min_keys: the module counts the keys the Hopper forward's middle row block would
    see (its tile bounds, evaluated on the host at the call's lengths and params), and below the
    spec's bound the Triton forward serves the call."""
    module = harness.load_target(load_spec("specs/sliding_window.toml"), "triton_gpu")
    assert module.SM90_FORWARD_MIN_KEYS == 2048
    assert module._sm90_keys_seen(16384, 16384, 1024) == 9 * 128  # the window's 8 blocks and the diagonal's
    assert module._sm90_keys_seen(16384, 16384, 4096) == 33 * 128
    assert module._sm90_keys_seen(1000, 1000, 4096) == 4 * 128  # rows 384..511 see keys 0..511
    local = harness.load_target(load_spec("specs/local_window.toml"), "triton_gpu")
    assert local._sm90_keys_seen(16384, 16384, 512, 512) == 9 * 128  # rows 8192..8319 see keys 7680..8831
    # Heads of 64: the Triton forward wins causal 1k, whose middle row block sees 640 keys, and loses
    # full 1k (1024 keys a program).
    narrow = {
        name: harness.load_target(retarget(load_spec(f"specs/{name}.toml"), 64, "bfloat16"), "triton_gpu")
        for name in ("causal", "full")
    }
    assert narrow["causal"].SM90_FORWARD_MIN_KEYS == narrow["full"].SM90_FORWARD_MIN_KEYS == 896
    assert narrow["causal"]._sm90_keys_seen(1024, 1024) == 640 and narrow["full"]._sm90_keys_seen(1024, 1024) == 1024
    # Bounds from tables built at run time (a mask that reads tensors, a packed form) are not host
    # code: there the Hopper forward serves every call.
    document = with_config(load_spec("specs/document.toml"), "triton_gpu", sm90_forward_min_keys=2048)
    assert "_sm90_keys_seen" not in _source(document)
    assert "_sm90_keys_seen" not in _source(packed(load_spec("specs/sliding_window.toml")))


def _source(spec) -> str:
    from attngen.backends.triton_gpu import TRITON_GPU
    from attngen.build import target_source

    return target_source(spec, TRITON_GPU)


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ("sm90_block_m = 64", "sm90_block_m must be 128 or 192"),
        ("sm90_num_warps = 8", "sm90_num_warps must be 4"),
        ("sm90_forward = 2", "sm90_forward must be 0 or 1"),
        ("sm90_dkdv_block_n = 32", "sm90_dkdv_block_n must be 64 or 128"),
        ("sm90_dq_block_m = 32", "sm90_dq_block_m must be 64 or 128"),
        (
            "sm90_dq = 1\nsm90_dq_block_n = 128\nsm90_dq_num_stages = 3",
            "the Hopper dQ kernel's tiles need more than sm90's 227 KiB",
        ),
        ("sm90_forward_min_keys = -1", "sm90_forward_min_keys must be in 0..2"),
        ("sm90_fused_min_queries = -1", "sm90_fused_min_queries must be in 0..2"),
        ("sm90_fused_num_warps = 8", "sm90_fused_num_warps must be 4"),
        ("sm90_fused_block_n = 64", "sm90_fused_block_n must be 128"),
        ("sm90_fused_block_m = 32", "sm90_fused_block_m must be 64 or 128"),
        ("sm90_fused_backward = 1\nsm90_fused_block_m = 128", "its tiles need more than sm90's 227 KiB"),
        ("sm90_fused_backward = 1\nsm90_backward = 0", "it needs the Hopper dK/dV kernel"),
    ],
)
def test_hopper_keys_are_checked(table, problem):
    text = f'name = "s"\nhead_dim = 128\ndtype = "bfloat16"\n[triton]\n{table}\n'
    with pytest.raises(SpecError, match=problem):
        parse_spec(text, "s.toml")
    wide = 'name = "s"\nhead_dim = 256\ndtype = "bfloat16"\n[triton]\nsm90_fused_backward = 1\n'
    with pytest.raises(SpecError, match="sm90_fused_backward: heads of at most 128"):
        parse_spec(wide, "s.toml")


@pytest.mark.parametrize("key", ["sm90_forward", "sm90_backward", "sm90_dq", "sm90_fused_backward"])
def test_a_float32_spec_cannot_ask_for_the_hopper_kernels(key):
    text = f'name = "s"\nhead_dim = 128\ndtype = "float32"\n[triton]\n{key} = 1\n'
    with pytest.raises(SpecError, match="wgmma takes no float32 inputs"):
        parse_spec(text, "s.toml")


# Compiles the fused backward's delta kernel for sm_90a, with and without dLSE, and prints its PTX's loads.
_COMPILE_DELTA = """
import json, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attngen.build import import_generated
module = import_generated(Path(sys.argv[1]), "_attngen_sm90_delta")
element = {"bfloat16": "*bf16", "float16": "*fp16"}[sys.argv[2]]
strides = ("o_stride_b", "o_stride_h", "o_stride_m", "do_stride_b", "do_stride_h", "do_stride_m")
fn = module._attention_bwd_delta
for dlse in ("*fp32", "constexpr"):
    types = {"O": element, "DO": element, "DLSE": dlse, "DELTA": "*fp32", "num_heads": "i32", "q_len": "i32",
             **dict.fromkeys(strides, "i32")}
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    values = {"HEAD_DIM_V": module.HEAD_DIM_V, "BLOCK_M": 64, "BLOCK_DV": module.BLOCK_DV, "DLSE": None}
    constexprs = {name: values[name] for name, kind in signature.items() if kind == "constexpr"}
    source = ASTSource(fn, signature, constexprs)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(json.dumps({"loads": ptx.count("ld.global")}))
"""


def test_the_fused_backwards_delta_in_the_interpreter():
    """delta = rowsum(dO * O) - dLSE, which the fused backward reads from a kernel of its own (the dQ
    kernels work it out beside dQ): a Triton kernel, so it runs here; with dO strided, or a gradient
    expanded from one element (strides 0), and without dLSE. It compiles for sm_90a too (where the
    interpreter allows what a compiled kernel may not: it read HEAD_DIM_V, a plain global, and ran
    here, where the H100 refused to compile it)."""
    import torch

    spec = with_config(load_spec("specs/causal.toml"), "triton_gpu", sm90_fused_backward=1)
    module = harness.load_target(spec, "triton_gpu")
    generator = torch.Generator().manual_seed(0)
    batch, heads, q_len, width = 2, 3, 70, module.HEAD_DIM_V  # two blocks of 64 rows, the second short
    out = torch.randn(batch, heads, q_len, width, generator=generator).to(module.DTYPE)
    strided = torch.randn(batch, q_len, heads, width, generator=generator).to(module.DTYPE).transpose(1, 2)
    expanded = torch.randn(1, 1, 1, 1, generator=generator).to(module.DTYPE).expand_as(out)
    given = torch.randn(batch, heads, q_len, generator=generator)
    for dout, dlse in ((strided, given), (expanded, None)):
        delta = torch.full((batch, heads, q_len), float("nan"))
        module._delta(dout, dlse, out, delta)
        expected = (dout.double() * out.double()).sum(-1) - (0 if dlse is None else dlse.double())
        torch.testing.assert_close(delta.double(), expected, rtol=1e-5, atol=1e-5)
    with_dlse, without = harness.compiled_structure(_COMPILE_DELTA, module.__file__, spec.dtype)
    assert with_dlse["loads"] > without["loads"] > 0  # (no dLSE: no load of it)
