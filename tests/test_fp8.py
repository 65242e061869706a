"""The FP8 forward (attention_fp8, Hopper only). Its Gluon kernel cannot run here: the CPU run checks
what feeds it (V^T in the order P's registers hold the keys, the descale table), its errors, its
config keys and its compiled structure; tests/test_gpu.py proves it exact for every spec on an H200."""

import pytest
import torch

from attngen.errors import SpecError
from attngen.exactness import FP8, allowed_error, check_forward
from attngen.reference import attention_ref_torch
from attngen.spec import load_spec, parse_spec, retarget, with_config
from attngen.testing import fp8_quantized
from tests import harness


def _module(name="causal"):
    return harness.load_target(load_spec(f"specs/{name}.toml"), "triton_gpu")


def _operand_order(column: int) -> int:
    """The key that V^T's column holds: 32c + 16i + 4j + 2a + z holds 32c + 16i + 8a + 2j + z."""
    c = column % 32
    return column - c + 16 * (c // 16) + 8 * (c // 2 % 2) + 2 * (c // 4 % 4) + c % 2


@pytest.mark.parametrize(("name", "block_n"), [("causal", None), ("causal", 32), ("value_dim", None)])
@pytest.mark.parametrize("kv_len", [1, 33, 130])
def test_v_is_transposed_into_the_order_of_ps_registers(name, block_n, kv_len):
    """In the Triton interpreter: V^T as a tile per block of keys ([BLOCK_DV, block_n], contiguous),
    padded with zeros, each 32 keys permuted as P's registers hold them, from contiguous and
    FlashAttention-layout (strided) v alike; also with the FP8 kernel's steps pinned to 32 keys."""
    spec = load_spec(f"specs/{name}.toml")
    if block_n:
        spec = with_config(spec, "triton_gpu", sm90_fp8_block_n=block_n)
    module = harness.load_target(spec, "triton_gpu")
    block_n, width = module.SM90_FP8_BLOCK_N, module.BLOCK_DV
    v = torch.randn(2, 3, kv_len, module.HEAD_DIM_V).to(torch.float8_e4m3fn)
    padded = -(-kv_len // block_n) * block_n
    assert sorted(_operand_order(c) for c in range(padded)) == list(range(padded))
    keys = torch.zeros(2, 3, padded, width, dtype=torch.uint8)  # [.., key, column of v], zero padded
    keys[:, :, :kv_len, : module.HEAD_DIM_V] = v.view(torch.uint8)
    columns = keys[:, :, [_operand_order(c) for c in range(padded)]].transpose(2, 3)  # V^T's columns in order
    wanted = columns.reshape(2, 3, width, padded // block_n, block_n).transpose(2, 3).reshape(2, 3, -1, block_n)
    for layout in (v, v.transpose(1, 2).contiguous().transpose(1, 2)):
        transposed = module._fp8_transposed(layout)
        assert transposed.is_contiguous() and transposed.stride(-2) % 16 == 0  # TMA's alignment
        assert torch.equal(transposed.view(torch.uint8), wanted)


def test_descale_factors_per_tensor_and_per_head():
    module = _module()
    q, k = torch.zeros(2, 8, 5, 128), torch.zeros(2, 4, 7, 128)
    per_head = torch.rand(2, 4) + 0.5
    table = module._fp8_descales(q.device, *k.shape[:2], per_head, torch.tensor([3.0]), None)
    assert table.shape == (2, 4, 2) and table.dtype == torch.float32
    assert torch.equal(table[..., 0], per_head * 3.0) and torch.equal(table[..., 1], torch.ones(2, 4))
    assert torch.equal(
        module._fp8_descales(q.device, *k.shape[:2], 2.0, None, 0.5), torch.tensor([4.0 / 2, 0.5]).expand(2, 4, 2)
    )
    with pytest.raises(ValueError, match=r"k_descale must be one number or \[batch, kv_heads\] = \[2, 4\]"):
        module._fp8_descales(q.device, *k.shape[:2], None, torch.ones(2, 8), None)


def test_attention_fp8_refuses_what_it_cannot_run():
    module = _module()
    q = torch.randn(1, 2, 8, 128).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="k is torch.bfloat16; this kernel was generated for torch.float8_e4m3fn"):
        module.attention_fp8(q, q.bfloat16(), q)
    with pytest.raises(RuntimeError, match=r"Hopper GPUs \(sm90\) only"):
        module.attention_fp8(q, q, q)
    float32 = harness.load_target(retarget(load_spec("specs/causal.toml"), 128, "float32"), "triton_gpu")
    assert not hasattr(float32, "attention_fp8")  # its output would be float32: no FP8 kernel


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ('dtype = "bfloat16"\n[triton]\nsm90_fp8_block_m = 64', "sm90_fp8_block_m must be 128 or 192"),
        ('dtype = "bfloat16"\n[triton]\nsm90_fp8_num_warps = 8', "sm90_fp8_num_warps must be 4"),
        ('dtype = "float32"\n[triton]\nsm90_fp8 = 1', "FP8 writes its output in the spec's dtype"),
    ],
)
def test_fp8_keys_are_checked(table, problem):
    with pytest.raises(SpecError, match=problem):
        parse_spec(f'name = "s"\nhead_dim = 128\n{table}\n', "s.toml")


def test_the_fp8_rule():
    """The baseline rounds P to e4m3 for P V: further from float64 than bf16 attention, nearer than
    FP8 rounding of everything; the rule judges the output by it and has no gradient rule."""
    spec = load_spec("specs/causal.toml")
    x = torch.randn(3, 1, 2, 64, 128)
    (q8, _, q), (_, _, k), (_, _, v) = (fp8_quantized(t, 2) for t in x)
    assert q8.dtype == torch.float8_e4m3fn and q8.float().abs().amax() == 448  # each group's amax is e4m3's
    assert (q - x[0]).abs().max() <= x[0].abs().max() / 16  # e4m3 keeps 3 bits of mantissa
    ref_out, ref_lse = attention_ref_torch(spec, q, k, v)
    base_out, base_lse = attention_ref_torch(spec, q, k, v, dtype=torch.float32, fp8_probs=True)
    bf16_out, _ = attention_ref_torch(spec, q, k, v, dtype=torch.bfloat16)
    error, bf16_error = ((o.double() - ref_out).abs().max().item() for o in (base_out, bf16_out))
    assert bf16_error < error < 0.1
    assert check_forward(FP8, base_out.bfloat16(), base_lse, ref_out, ref_lse, base_out.bfloat16()).ok
    assert not check_forward(FP8, base_out.bfloat16() + 3 * error, base_lse, ref_out, ref_lse, base_out).ok
    with pytest.raises(ValueError, match="forward only"):
        allowed_error("dq", FP8, 0.1)


_INSPECT = """
import json, re, sys
from pathlib import Path
from attngen.backends.triton_gpu import TRITON_GPU
from attngen.build import import_generated
from attngen.check.gpu import compile_kernel
module = import_generated(Path(sys.argv[1]), "_attngen_fp8_structure")
for name in ("fwd_sm90", "fwd_sm90_fp8"):
    ptx = compile_kernel(module, TRITON_GPU.kernel(name), "bfloat16", 90).asm["ptx"]
    print(json.dumps({
        "wgmma": ptx.count("wgmma.mma_async"),
        "e4m3": ptx.count("wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3"),
        "shuffles": ptx.count("shfl.sync.idx"),
        "local": ptx.count("ld.local") + ptx.count("st.local"),
    }))
"""


def test_the_fp8_kernel_multiplies_in_fp8_and_moves_p_within_threads():
    """Compiled for sm_90a beside the bf16 kernel of the same spec: both products run in e4m3, and
    P reaches P V's operand layout with no more shuffles than the bf16 kernel's."""
    module = _module("document")  # block tables: the longest kernel
    bf16, fp8 = harness.compiled_structure(_INSPECT, module.__file__)[-2:]
    assert fp8["wgmma"] == fp8["e4m3"] > 0 and bf16["e4m3"] == 0
    assert fp8["shuffles"] <= bf16["shuffles"]
    assert fp8["local"] == 0
