"""Target: Triton for NVIDIA (and AMD) GPUs, on torch tensors.

Owns the [triton] table (keys, checks, defaults from the tuned table) and declares the Triton
kernels: the forward (long and short tiles), the dQ kernel and the dK/dV kernel.
"""

import json
import tomllib
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path

from attngen.analysis.tiles import BY_KEY_BLOCK, BY_QUERY_BLOCK
from attngen.backends.base import (
    F32_POINTER,
    FP8,
    I32,
    I32_POINTER,
    INPUT_POINTER,
    NOT_PASSED,
    PROBLEM_ARGS,
    Arg,
    Backend,
    Counted,
    Kernel,
    ProblemShape,
    Report,
    desc,
    power_of_two_at_least,
)
from attngen.backends.emit import Dialect


def _sm90_fused_by_default(shape: ProblemShape) -> bool:
    """Whether the fused Hopper backward serves a spec of this shape by default (where it can run):
    plain attention and the causal mask at heads of 65-128. On an H100, forward + backward of plain
    attention at 16k keys ran 1.01-1.09x the dQ and dK/dV kernels in four runs (1.04x at 4k), causal
    1.01-1.06x at 16k and 1.03x at 4k in five (calls of up to 2048 queries keep the two kernels:
    sm90_fused_min_queries). Not at heads of 64 (0.96x plain), nor under other masks and scores:
    0.96-1.02x under prefix-LM, softcap, a sliding window, chunked and ALiBi slopes read from a
    tensor (BENCHMARKS.md, 2026-12-05). A spec takes it or leaves it with sm90_fused_backward."""
    return (shape.plain or shape.causal) and 64 < shape.widest <= 128


@dataclass(frozen=True)
class TritonConfig:
    """Tile sizes and pipelining of the Triton kernels; unset keys come from the tuned table
    (default_config)."""

    # Forward: block_m queries per program, block_n keys per step.
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Forward over short key sequences (kv_len <= short_kv_len): programs that see few keys pay
    # their prologue and epilogue in full, so smaller tiles that let two programs share an SM win.
    short_kv_len: int
    short_block_m: int
    short_block_n: int
    short_num_warps: int
    short_num_stages: int
    # Backward: the dQ kernel holds dq_block_m queries and steps over dq_block_n keys; the dK/dV
    # kernel holds dkdv_block_n keys and steps over dkdv_block_m queries.
    dq_block_m: int
    dq_block_n: int
    dq_num_warps: int
    dq_num_stages: int
    dkdv_block_m: int
    dkdv_block_n: int
    dkdv_num_warps: int
    dkdv_num_stages: int
    # Decoding from a KV cache: up to decode_block_m query rows (the new tokens of every query
    # head of one kv head, packed) per program, decode_block_n cached keys per step; the keys of a
    # sequence are split so that the grid holds decode_programs_per_sm programs per SM, or about
    # eight times as many (the generated module's _decode_splits has the rule, BENCHMARKS.md the
    # sweeps). Not in the tuned table yet: these defaults hold for every GPU.
    decode_block_m: int = 64
    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 3
    decode_programs_per_sm: int = 2
    # The Hopper forward (Gluon, sm90 only; the forward above serves other GPUs): sm90_block_m
    # query rows per program, in consumer warpgroups of 64 (wgmma's tile height): 128 (two) or 192
    # (three, FlashAttention-3's choice at heads of 64), sm90_block_n keys per step through a ring
    # of sm90_num_stages K/V buffers; sm90_num_warps is each consumer's (one warpgroup).
    # sm90_forward = 0 turns it off; make_config sets its default (fp16 and bf16 only: wgmma takes
    # no float32 inputs).
    sm90_forward: int = 1
    sm90_block_m: int = 128
    sm90_block_n: int = 128
    sm90_num_warps: int = 4
    sm90_num_stages: int = 2
    # A call whose programs see few keys (a short window) runs the Triton forward instead: the
    # Hopper forward serves it only if its middle row block sees more than sm90_forward_min_keys
    # keys, by the forward's tile bounds at the call's lengths and params (0: every call; so does a
    # mask that reads tensors, whose bounds come from tables built at run time). With a
    # window of 1024 the Triton forward's 64 x 64 tiles ran 1.21x as fast as the Hopper forward,
    # with one of 4096 the Hopper forward 1.13x as fast (H200, BENCHMARKS.md, 2026-12-03). Heads of
    # 64 default to 896 (make_config).
    sm90_forward_min_keys: int = 0
    # The same kernel over FP8 e4m3 inputs (attention_fp8, Hopper only): its own tiles, as FP8 halves
    # the bytes of a K/V tile. sm90_fp8 = 0 leaves attention_fp8 out of the module.
    sm90_fp8: int = 1
    sm90_fp8_block_m: int = 128
    sm90_fp8_block_n: int = 128
    sm90_fp8_num_warps: int = 4
    sm90_fp8_num_stages: int = 2
    # The Hopper dK/dV kernel: sm90_dkdv_block_n keys per program, sm90_dkdv_block_m queries per step
    # through a ring of sm90_dkdv_num_stages Q/dO buffers. Of 128 keys each of the two consumer
    # warpgroups holds 64, with their dK and dV rows; of 64 keys (heads wider than 128, make_config)
    # both hold all and each half of dK's and dV's columns, as 64 float32 rows of such a head's dK and
    # dV pass a warpgroup's registers. sm90_backward = 0 turns it off (make_config sets its default
    # like sm90_forward's).
    sm90_backward: int = 1
    sm90_dkdv_block_m: int = 64
    sm90_dkdv_block_n: int = 128
    sm90_dkdv_num_warps: int = 4
    sm90_dkdv_num_stages: int = 2
    # The Hopper dQ kernel: sm90_dq_block_m queries per program, sm90_dq_block_n keys per step
    # through a ring of sm90_dq_num_stages K/V buffers. Of 128 queries each of the two consumer
    # warpgroups holds 64; of 64 (heads of 256, where Q, dO and O of 128 queries beside the ring pass
    # sm90's shared memory: make_config) both hold all and each half of dQ's columns. sm90_dq = 0
    # turns it off (make_config sets its default like sm90_backward's). A call whose trained params
    # want gradients runs the dQ kernel above, which gathers them.
    sm90_dq: int = 1
    sm90_dq_block_m: int = 128
    sm90_dq_block_n: int = 64
    sm90_dq_num_warps: int = 4
    sm90_dq_num_stages: int = 2
    # The fused Hopper backward (FlashAttention-3's): the dK/dV kernel doing the dQ kernel's work too,
    # five products a step where the two kernels do seven, dQ added up in float32 by TMA reductions in
    # an order that varies from run to run. sm90_fused_block_n keys per program (64 per consumer),
    # sm90_fused_block_m queries per step through a ring of sm90_fused_num_stages Q/dO buffers. For
    # heads up to 128 (make_config sets its default: _sm90_fused_by_default); calls that want
    # deterministic gradients, or gradients of trained params, run the two kernels above.
    sm90_fused_backward: int = 0
    # A call of at most sm90_fused_min_queries queries runs the two kernels instead (0: every call
    # takes the fused one): each fused program walks every query block of its keys, and short walks
    # lose. Plain attention, D = 128, forward + backward, fused / the two kernels on an H100: 0.95-0.97x
    # at 1k queries, 0.99-1.00x at 2k, 1.04x at 4k, 1.06-1.09x at 16k (BENCHMARKS.md, 2026-12-05,
    # "the fused backward by length"). make_config sets 2048.
    sm90_fused_min_queries: int = 0
    sm90_fused_block_m: int = 64
    sm90_fused_block_n: int = 128
    sm90_fused_num_warps: int = 4
    sm90_fused_num_stages: int = 2

    def tiles(self, kernel: Kernel) -> dict[str, int]:
        """block_m, block_n, num_warps and num_stages of one kernel."""
        return {key: getattr(self, f"{kernel.tiles}{key}") for key in TILE_KEYS}

    def pointer_tiles(self, kernel: Kernel) -> dict[str, int]:
        """The tiles of a Triton kernel on NVIDIA GPUs without TMA (sm80, sm89). There mma.sync reads
        its operands from registers and tiles move through pointers, so the tuned (H200) tiles spill:
        8-320 bytes a thread at D = 128 on sm80. At most 64 rows a program over 8 warps, and dK/dV
        steps of 16 queries, compile with no spill for every spec in specs/ (`attngen check --target
        sm80`); they are not timed (no such GPU here)."""
        tiles = self.tiles(kernel)
        held = 16 if kernel.tiles == "dkdv_" else 64  # the dK/dV kernel holds block_n keys, steps block_m
        if kernel.tiles != "decode_":  # (the decode kernel's block_m is the packed query rows, at most 64)
            tiles["block_m"] = min(tiles["block_m"], held)
        if kernel.tiles != "dkdv_":
            tiles["block_n"] = min(tiles["block_n"], 64)
        tiles["num_warps"] = 8
        return tiles


TILE_KEYS = ("block_m", "block_n", "num_warps", "num_stages")
CONFIG_KEYS = tuple(f.name for f in fields(TritonConfig))


# Each kernel declared once. Its tensors: descriptors of BLOCK_M or BLOCK_N rows, head_dim ("d")
# or head_dim_v ("dv") wide, and float32 pointers (LSE, delta, dLSE); then the problem's sizes.
_FORWARD = {
    "family": "training",
    "function": "_attention_fwd",
    "template": "fwd.py.jinja",
    "walks": BY_QUERY_BLOCK,
    "step": "BLOCK_N",
    "arguments": (
        ("q_desc", desc("BLOCK_M")),
        ("k_desc", desc("BLOCK_N")),
        ("v_desc", desc("BLOCK_N", "dv")),
        ("o_desc", desc("BLOCK_M", "dv")),
        ("LSE", F32_POINTER),
        *PROBLEM_ARGS,
    ),
    "constexprs": (("GROUP", 1),),
}


def _dkdv_sm90(fused: bool) -> dict:
    """The Hopper dK/dV kernel's declaration, alone or fused (then it adds dQ's share of each step to
    DQ_SUMS, float32 [batch, heads, q_len, head_dim], each consumer half of its columns)."""
    return {
        "family": "training",
        "function": "_attention_bwd_dkdv_sm90",
        "template": "bwd_dkdv_sm90.py.jinja",
        "walks": BY_KEY_BLOCK,
        "step": "BLOCK_M",
        "arguments": (
            ("q_desc", Arg("nvmma_desc", "BLOCK_M")),
            ("k_desc", Arg("nvmma_desc", "WGMMA_ROWS")),
            ("v_desc", Arg("nvmma_desc", "WGMMA_ROWS", "dv")),
            ("do_desc", Arg("nvmma_desc", "BLOCK_M", "dv")),
            ("LSE", F32_POINTER),
            ("DELTA", F32_POINTER),
            ("DK", INPUT_POINTER),  # float32 partial sums when SPLITS > 1
            ("DV", INPUT_POINTER),
            ("DQ_SUMS", Arg("nvmma_desc", "BLOCK_M", "d_half", element="float32") if fused else NOT_PASSED),
            ("TILE_COUNTER", I32_POINTER),  # the tiles taken, for the dynamic persistent walk
            *PROBLEM_ARGS,
            ("units", I32),  # batch * kv_heads * SPLITS: the grid's tiles are kv blocks x this
            ("section_units", I32),  # units whose Q and dO share L2 (_sm90_section)
        ),
        "constexprs": (("GROUP", 1), ("SPLITS", 1)),
        "language": "gluon",
        "capabilities": (90,),
    }


def _forward_sm90(element: str = "") -> dict:
    """The Hopper forward's declaration, over inputs of the spec's dtype or of FP8 e4m3 (then V
    transposed, its keys the tiles' columns, and DESCALE: [batch, kv_heads, 2] float32)."""
    v = Arg("nvmma_desc", "BLOCK_DV", "BLOCK_N", element=FP8) if element else Arg("nvmma_desc", "BLOCK_N", "dv")
    return {
        "family": "fp8" if element else "training",
        "function": "_attention_fwd_sm90",
        "template": "fwd_sm90.py.jinja",
        "walks": BY_QUERY_BLOCK,
        "step": "BLOCK_N",
        "arguments": (
            ("q_desc", Arg("nvmma_desc", "WGMMA_ROWS", element=element)),
            ("k_desc", Arg("nvmma_desc", "BLOCK_N", element=element)),
            ("v_desc", v),
            ("o_desc", Arg("nvmma_desc", "WGMMA_ROWS", "dv")),
            ("LSE", F32_POINTER),
            ("DESCALE", F32_POINTER if element else NOT_PASSED),
            ("TILE_COUNTER", I32_POINTER),  # the tiles taken, for the dynamic persistent walk
            *PROBLEM_ARGS,
            ("batch_heads", I32),  # batch * num_heads: the grid's tiles are query blocks x this
            ("section_heads", I32),  # (batch, head) pairs whose K and V share L2 (_sm90_section)
        ),
        "language": "gluon",
        "capabilities": (90,),
    }


KERNELS = (
    Kernel("fwd", about="Forward: BLOCK_M queries per program, BLOCK_N keys per step.", **_FORWARD),
    Kernel(
        "fwd_short",
        about="Forward at kv_len <= SHORT_KV_LEN: smaller tiles, two programs per SM hide each other's prologue.",
        tiles="short_",
        enabled_by="short_kv_len",
        **_FORWARD,
    ),
    Kernel(
        "bwd_dq",
        "training",
        "_attention_bwd_dq",
        "bwd_dq.py.jinja",
        about="Backward, dQ: DQ_BLOCK_M queries per program, DQ_BLOCK_N keys per step.",
        walks=BY_QUERY_BLOCK,
        step="BLOCK_N",
        tiles="dq_",
        arguments=(
            ("q_desc", desc("BLOCK_M")),
            ("k_desc", desc("BLOCK_N")),
            ("v_desc", desc("BLOCK_N", "dv")),
            ("o_desc", desc("BLOCK_M", "dv")),
            ("do_desc", desc("BLOCK_M", "dv")),
            ("LSE", F32_POINTER),
            ("DLSE", F32_POINTER),  # None where the caller left lse unused: no load, a kernel of its own
            ("DELTA", F32_POINTER),
            ("dq_desc", desc("BLOCK_M")),
            *PROBLEM_ARGS,
        ),
        constexprs=(("GROUP", 1), ("TRAIN", 1)),  # TRAIN: where the spec trains params ([grad])
    ),
    Kernel(
        "bwd_dkdv",
        "training",
        "_attention_bwd_dkdv",
        "bwd_dkdv.py.jinja",
        about="Backward, dK/dV: DKDV_BLOCK_N keys per program, DKDV_BLOCK_M queries per step.",
        walks=BY_KEY_BLOCK,
        step="BLOCK_M",
        tiles="dkdv_",
        arguments=(
            ("q_desc", desc("BLOCK_M")),
            ("k_desc", desc("BLOCK_N")),
            ("v_desc", desc("BLOCK_N", "dv")),
            ("do_desc", desc("BLOCK_M", "dv")),
            ("LSE", F32_POINTER),
            ("DELTA", F32_POINTER),
            ("dk_desc", desc("BLOCK_N")),
            ("dv_desc", desc("BLOCK_N", "dv")),
            *PROBLEM_ARGS,
        ),
        # GQA group 1 in one part: each group size and split compiles a kernel of its own.
        constexprs=(("GROUP", 1), ("SPLITS", 1)),
    ),
    Kernel(
        "decode",
        "kvcache",
        "_decode_fwd",
        "decode.py.jinja",
        about="Decoding from a KV cache: DECODE_BLOCK_M packed query rows per program, DECODE_BLOCK_N keys per step.",
        walks=BY_QUERY_BLOCK,
        step="BLOCK_N",
        tiles="decode_",
        arguments=(
            ("Q", INPUT_POINTER),
            ("K", INPUT_POINTER),
            ("V", INPUT_POINTER),
            ("O", INPUT_POINTER),
            ("LSE", F32_POINTER),
            ("O_PARTS", F32_POINTER),
            ("LSE_PARTS", F32_POINTER),
            ("SPLITS_DONE", I32_POINTER),
            ("CACHE_SEQLENS", I32_POINTER),
            ("CACHE_LEFTPAD", I32_POINTER),
            ("BLOCK_TABLE", I32_POINTER),
            ("CU_SEQLENS_Q", I32_POINTER),
            ("KV_DESCALE", F32_POINTER),
            ("num_heads", Arg("i32", divisible=True)),
            ("batch", Arg("i32")),
            ("new_tokens", Arg("i32")),
            ("capacity", Arg("i32")),
            ("num_pages", Arg("i32")),
            ("table_stride", Arg("i32")),
            ("k_stride_page", Arg("i32", divisible=True)),
            ("k_stride_head", Arg("i32", divisible=True)),
            ("k_stride_row", Arg("i32", divisible=True)),
            ("v_stride_page", Arg("i32", divisible=True)),
            ("v_stride_head", Arg("i32", divisible=True)),
            ("v_stride_row", Arg("i32", divisible=True)),
            ("q_stride_b", Arg("i32", divisible=True)),
            ("q_stride_h", Arg("i32", divisible=True)),
            ("q_stride_t", Arg("i32", divisible=True)),
            ("scale", Arg("fp32")),
        ),
        # One query head per kv head, a contiguous cache (PAGE_SIZE 0), as many new tokens in every
        # sequence (RAGGED 0), no descale factors (DESCALED 0: an FP8 cache's), no split: each of those
        # (and each page size) compiles a kernel of its own.
        constexprs=(
            ("GROUP", 1),
            ("PAGE_SIZE", 0),
            ("LEFTPAD", 0),
            ("RAGGED", 0),
            ("DESCALED", 0),
            ("SPLIT", 0),
            ("MERGE_M", 1),
            ("MERGE_SPLITS", 1),
        ),
    ),
    Kernel(
        "fwd_sm90",
        about="Forward on Hopper (Gluon): SM90_BLOCK_M queries per program in two consumer warpgroups, SM90_BLOCK_N keys per step.",
        enabled_by="sm90_forward",
        tiles="sm90_",
        constexprs=(("GROUP", 1), ("FP8", 0)),
        **_forward_sm90(),
    ),
    Kernel(
        "fwd_sm90_fp8",
        about="Forward on Hopper in FP8 (attention_fp8): e4m3 q, k, v^T with descale factors, SM90_FP8_BLOCK_M queries per program, SM90_FP8_BLOCK_N keys per step.",
        enabled_by="sm90_fp8",
        tiles="sm90_fp8_",
        constexprs=(("GROUP", 1), ("FP8", 1)),
        **_forward_sm90(FP8),
    ),
    Kernel(
        "bwd_dkdv_sm90",
        about="Backward, dK/dV on Hopper (Gluon): SM90_DKDV_BLOCK_N keys per program (128: half per consumer warpgroup; 64: all for both, which split the columns), SM90_DKDV_BLOCK_M queries per step.",
        tiles="sm90_dkdv_",
        enabled_by="sm90_backward",
        **_dkdv_sm90(fused=False),
    ),
    Kernel(
        "bwd_fused_sm90",
        about="Backward on Hopper, fused (Gluon): dK/dV of SM90_FUSED_BLOCK_N keys per program (half per consumer warpgroup), and dQ's share of each step of SM90_FUSED_BLOCK_M queries added to float32 sums.",
        tiles="sm90_fused_",
        enabled_by="sm90_fused_backward",
        **_dkdv_sm90(fused=True),
    ),
    Kernel(
        "bwd_dq_sm90",
        "training",
        "_attention_bwd_dq_sm90",
        "bwd_dq_sm90.py.jinja",
        about="Backward, dQ on Hopper (Gluon): SM90_DQ_BLOCK_M queries per program (128: half per consumer warpgroup; 64: all for both, which split the columns), SM90_DQ_BLOCK_N keys per step.",
        walks=BY_QUERY_BLOCK,
        step="BLOCK_N",
        tiles="sm90_dq_",
        arguments=(
            ("q_desc", Arg("nvmma_desc", "WGMMA_ROWS")),
            ("k_desc", Arg("nvmma_desc", "BLOCK_N")),
            ("v_desc", Arg("nvmma_desc", "BLOCK_N", "dv")),
            ("o_desc", Arg("nvmma_desc", "WGMMA_ROWS", "dv")),
            ("do_desc", Arg("nvmma_desc", "WGMMA_ROWS", "dv")),
            ("LSE", F32_POINTER),
            ("DLSE", F32_POINTER),  # None where the caller left lse unused: no load, a kernel of its own
            ("DELTA", F32_POINTER),
            ("dq_desc", Arg("nvmma_desc", "WGMMA_ROWS")),  # dQ's tiles of 128-query blocks
            ("DQ", INPUT_POINTER),  # dQ's columns of 64-query blocks
            ("TILE_COUNTER", I32_POINTER),  # the tiles taken, for the dynamic persistent walk
            *PROBLEM_ARGS,
            ("batch_heads", I32),  # batch * num_heads: the grid's tiles are query blocks x this
            ("section_heads", I32),  # (batch, head) pairs whose K and V share L2 (_sm90_section)
        ),
        constexprs=(("GROUP", 1),),
        enabled_by="sm90_dq",
        language="gluon",
        capabilities=(90,),
    ),
)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def make_config(table: dict[str, int], shape: ProblemShape | None, report: Report) -> TritonConfig | None:
    """The [triton] keys a spec sets, checked, over the tuned table's entry for its shape. Forward
    tiles pinned without short_* keys are pinned for every length: no short-sequence forward."""
    report = Counted(report)
    prefixes = tuple(dict.fromkeys(k.tiles for k in KERNELS))
    for key in (f"{prefix}{block}" for prefix in prefixes for block in ("block_m", "block_n")):
        if key in ("sm90_block_m", "sm90_fp8_block_m"):
            if table.get(key, 128) not in (128, 192):
                why = "two or three consumer warpgroups of 64 rows, wgmma's tile height"
                report(f"triton {key} must be 128 or 192 ({why}), got {table[key]}", key)
        elif key in table and not (_power_of_two(table[key]) and 16 <= table[key] <= 256):
            report(f"triton {key} must be a power of two in 16..256, got {table[key]}", key)
    for key in (f"{prefix}num_warps" for prefix in prefixes):
        if key in table and table[key] not in (1, 2, 4, 8, 16):
            report(f"triton {key} must be 1, 2, 4, 8 or 16, got {table[key]}", key)
    for key in (f"{prefix}num_stages" for prefix in prefixes):
        if key in table and not 1 <= table[key] <= 8:
            report(f"triton {key} must be in 1..8, got {table[key]}", key)
    for key, value, why in (
        ("sm90_num_warps", 4, "each consumer is one warpgroup"),
        ("sm90_fp8_num_warps", 4, "each consumer is one warpgroup"),
        ("sm90_dkdv_num_warps", 4, "each consumer is one warpgroup"),
        ("sm90_dq_num_warps", 4, "each consumer is one warpgroup"),
        ("sm90_fused_num_warps", 4, "each consumer is one warpgroup"),
        ("sm90_fused_block_n", 128, "64 keys per consumer warpgroup, wgmma's tile height"),
    ):
        if key in table and table[key] != value:
            report(f"triton {key} must be {value} ({why}), got {table[key]}", key)
    for key, rows in (("sm90_dkdv_block_n", "keys"), ("sm90_dq_block_m", "queries")):
        if table.get(key, 64) not in (64, 128):
            why = f"64 {rows} per consumer warpgroup, or 64 for both, wgmma's tile height"
            report(f"triton {key} must be 64 or 128 ({why}), got {table[key]}", key)
    if table.get("sm90_fused_block_m", 64) not in (64, 128):
        why = "a step's dQ tile is one or two of wgmma's 64 rows"
        report(
            f"triton sm90_fused_block_m must be 64 or 128 ({why}), got {table['sm90_fused_block_m']}",
            "sm90_fused_block_m",
        )
    for key in ("sm90_forward", "sm90_backward", "sm90_dq", "sm90_fp8", "sm90_fused_backward"):
        if key in table and table[key] not in (0, 1):
            report(f"triton {key} must be 0 or 1, got {table[key]}", key)
        if table.get(key) and shape is not None and shape.dtype == "float32":
            why = "FP8 writes its output in the spec's dtype" if key == "sm90_fp8" else "wgmma takes no float32 inputs"
            report(f"triton {key} needs fp16 or bf16: {why}", key)
    for key, off in (
        ("short_kv_len", "the short-sequence forward"),
        ("sm90_forward_min_keys", "the choice by keys"),
        ("sm90_fused_min_queries", "the choice by queries"),
    ):
        if key in table and not 0 <= table[key] < 2**31:
            report(f"triton {key} must be in 0..2**31-1, got {table[key]}", key, f"0 turns {off} off")
    if report.count or shape is None:  # (no shape: a spec with other problems; values checked only)
        return None
    config = {**default_config(shape.widest, shape.dtype), **table}
    # On by default where they are measured faster than the Triton kernels (BENCHMARKS.md, H200): fp16
    # and bf16 with heads of 64 and wider. At 64 the backward runs 1.05-1.17x the Triton one from 4k
    # keys (a tie at 1k), the forward 1.03-1.10x from 4k keys and 1.06x at full 1k, but 0.71x at causal
    # 1k, whose middle row block sees 640 keys: there calls whose programs see at most 896 keys take
    # the Triton forward. Not where the score reads a tensor at each pair (a full bias): the Triton
    # kernels pipeline its tiles like K's and V's, where the Hopper kernels' consumers wait for each
    # tile's loads (specs/bias.toml, 4k: forward 1.10x, forward + backward 1.19x as fast with the Triton
    # kernels, 2026-12-04).
    hopper = shape.dtype != "float32" and shape.widest >= 64 and not shape.pair_reads
    config.setdefault("sm90_forward", int(hopper))
    config.setdefault("sm90_dkdv_block_n", 128 if shape.widest <= 128 else 64)
    config.setdefault("sm90_backward", int(hopper and _sm90_dkdv_fits(config, shape)))
    if table.get("sm90_backward") and not _sm90_dkdv_fits(config, shape):
        report(
            f"triton sm90_backward: the Hopper dK/dV kernel's tiles need more than sm90's {SM90_SHARED_BYTES // 1024} "
            f"KiB of shared memory at head dims {shape.head_dim} / {shape.head_dim_v}",
            "sm90_backward",
            "fewer sm90_dkdv_num_stages or a smaller sm90_dkdv_block_n, or sm90_backward = 0",
        )
        return None
    if hopper and shape.widest == 64:
        config.setdefault("sm90_forward_min_keys", 896)
    config.setdefault("sm90_dq_block_m", 128 if _sm90_dq_fits({**config, "sm90_dq_block_m": 128}, shape) else 64)
    config.setdefault("sm90_dq", int(config["sm90_backward"] and _sm90_dq_fits(config, shape)))
    if table.get("sm90_dq") and not _sm90_dq_fits(config, shape):
        report(
            f"triton sm90_dq: the Hopper dQ kernel's tiles need more than sm90's {SM90_SHARED_BYTES // 1024} KiB of "
            f"shared memory at head dims {shape.head_dim} / {shape.head_dim_v}",
            "sm90_dq",
            "fewer sm90_dq_num_stages or a smaller sm90_dq_block_n, or sm90_dq = 0",
        )
        return None
    fused = bool(config["sm90_backward"]) and shape.widest <= 128 and _sm90_fused_fits(config, shape)
    config.setdefault("sm90_fused_backward", int(fused and _sm90_fused_by_default(shape)))
    config.setdefault("sm90_fused_min_queries", 2048)
    if table.get("sm90_fused_backward") and not fused:
        why = (
            "it needs the Hopper dK/dV kernel (sm90_backward)"
            if not config["sm90_backward"]
            else f"heads of at most 128 (head dims {shape.head_dim} / {shape.head_dim_v})"
            if shape.widest > 128
            else f"its tiles need more than sm90's {SM90_SHARED_BYTES // 1024} KiB of shared memory"
        )
        report(f"triton sm90_fused_backward: {why}", "sm90_fused_backward", "sm90_fused_backward = 0")
        return None
    # FP8 has no other kernel: on for every head dim, its output in the spec's dtype.
    config.setdefault("sm90_fp8", int(shape.dtype != "float32"))
    # Three consumer warpgroups (192 queries a program, FlashAttention-3's tiles) at heads of 64, where
    # every tile is plain attention: 1.06-1.07x two at 4k-16k keys. Not under a mask or a score: their
    # tiles spill at 160 registers a consumer (document, sliding window) or run slower (causal 4k 0.82x,
    # sliding window 0.51x; H200, BENCHMARKS.md, 2026-12-04, "three consumers").
    config.setdefault("sm90_block_m", 192 if shape.plain and shape.widest <= 64 else 128)
    # K and V tiles of 128 keys fit the ring for head dims up to 128; wider heads take 64 keys.
    for key in ("sm90_block_n", "sm90_fp8_block_n"):
        config.setdefault(key, 128 if shape.widest <= 128 else 64)
    # FP8's tiles are half as wide: at head dims up to 128 its ring holds four K/V stages (176 KiB),
    # 1.01-1.03x two at 16k keys, 1.03-1.04x at 4k (H200, BENCHMARKS.md, 2026-12-04, "four stages").
    config.setdefault("sm90_fp8_num_stages", 4 if shape.widest <= 128 else 2)
    # A gradient written per pair makes the dQ kernel store a float32 tile of block_m x block_n per
    # step: with 64 keys a step at D = 128 it passes sm90's shared memory (257 KiB, `attngen check`).
    # A relative table's gradient skews each dQ tile into block_m x 2 * max(block_m, block_n) floats
    # (its diagonals as columns): at D = 128 it spills 320-1000 bytes on sm90 unless 64 x 32.
    if (shape.per_pair_grads or shape.relative_grads) and "dq_block_n" not in table:
        config["dq_block_n"] = min(config["dq_block_n"], 32)
    if shape.relative_grads and "dq_block_m" not in table:
        config["dq_block_m"] = min(config["dq_block_m"], 64)
    if table.keys() & set(TILE_KEYS) and not any(k.startswith("short_") for k in table):
        config["short_kv_len"] = 0
    return TritonConfig(**config)


# Shared memory a block may use on sm90 (H100, H200); attngen check's sm90 target reads it too.
SM90_SHARED_BYTES = 227 * 1024


def _sm90_dq_fits(config: dict[str, int], shape: ProblemShape) -> bool:
    """Whether the Hopper dQ kernel's tiles fit sm90's shared memory: Q, dO and O of its queries,
    its ring of K/V tiles and, for 64 queries where O's tile cannot hold them, dS's exchange buffers
    (2 steps x [64, step]), all of 16-bit elements (heads of 256 fit at 64 x 64 tiles, not 128 x 64)."""
    keys = ("sm90_dq_block_m", "sm90_dq_block_n", "sm90_dq_num_stages")
    rows, step, stages = (config.get(key, getattr(TritonConfig, key)) for key in keys)
    d, dv = power_of_two_at_least(shape.head_dim), power_of_two_at_least(shape.head_dim_v)
    ds = 2 * rows * step if rows == 64 and 2 * step > dv else 0
    return 2 * (rows * (d + 2 * dv) + stages * step * (d + dv) + ds) <= SM90_SHARED_BYTES


def _sm90_fused_fits(config: dict[str, int], shape: ProblemShape) -> bool:
    """Whether the fused Hopper backward's tiles fit sm90's shared memory: the dK/dV kernel's (K and V,
    the Q/dO ring with LSE and delta), and dS^T of both consumers over two steps, 16-bit, and a float32
    [step, head_dim / 2] tile of dQ per consumer on its way out."""
    keys = ("sm90_fused_block_m", "sm90_fused_block_n", "sm90_fused_num_stages")
    step, rows, stages = (config.get(key, getattr(TritonConfig, key)) for key in keys)
    d, dv = power_of_two_at_least(shape.head_dim), power_of_two_at_least(shape.head_dim_v)
    tiles = 2 * (rows + stages * step) * (d + dv) + 8 * stages * step
    return tiles + 2 * 2 * rows * step + 4 * step * d <= SM90_SHARED_BYTES


def _sm90_dkdv_fits(config: dict[str, int], shape: ProblemShape) -> bool:
    """Whether the Hopper dK/dV kernel's tiles fit sm90's shared memory: K and V of its keys, and its
    ring of Q/dO tiles with their rows of LSE and delta (heads of 256 fit at 64 x 64 tiles, not 128 x 64)."""
    keys = ("sm90_dkdv_block_m", "sm90_dkdv_block_n", "sm90_dkdv_num_stages")
    step, rows, stages = (config.get(key, getattr(TritonConfig, key)) for key in keys)
    d, dv = power_of_two_at_least(shape.head_dim), power_of_two_at_least(shape.head_dim_v)
    return 2 * (rows + stages * step) * (d + dv) + 8 * stages * step <= SM90_SHARED_BYTES


def tensor_args(name: str, rank: int) -> tuple[str, ...]:
    """A tensor param reaches the kernels as its (contiguous) data and the size of each axis;
    the template's load_<name> helper reads elements (the printer clamps the indices)."""
    return (name, *(f"{name}_size{axis}" for axis in range(rank)))


def _no_tensor_on_the_host(*_):
    raise AssertionError("host code reads no tensor: attngen.plan._host_expressible keeps such bounds out")


TRITON_GPU = Backend(
    name="triton_gpu",
    template="triton_gpu/module.py.jinja",
    dialect=Dialect(
        functions={
            "exp": "tl.exp",
            "log": "tl.log",
            "sqrt": "tl.sqrt",
            "tanh": "tanh",  # helper: libdevice is unavailable under TRITON_INTERPRET
            "sin": "tl.sin",
            "cos": "tl.cos",
            "tan": "tan",  # helper: Triton has no tl.tan (libdevice's is unavailable, as above)
            "exp2": "tl.exp2",
            "log2": "tl.log2",
            "abs": "tl.abs",
            "min": "tl.minimum",
            "max": "tl.maximum",
        },
        where="tl.where",
        # (== 0, not ~: an operand the language folds to a Python bool at trace time, such as
        # `not (33 < 25)`, would become ~False == -1, a true value that compares unequal to True)
        logical_not=lambda x: f"({x} == 0)",
        to_float=lambda x: f"{x}.to(tl.float32)",
        floordiv="floordiv",  # helpers: Triton's // and % truncate toward zero
        floormod="floormod",
        load=lambda tensor, indices: f"load_{tensor}({', '.join(tensor_args(tensor, len(indices)) + tuple(indices))})",
        clamp=lambda index, tensor, axis: f"clamped({index}, {tensor}_size{axis})",
    ),
    param_prefix="param_",
    kernels=KERNELS,
    config_table="triton",
    config_keys=CONFIG_KEYS,
    make_config=make_config,
    symbolic_blocks=True,  # BLOCK_M, BLOCK_N are each kernel's constexprs
    helper_functions=frozenset({"tanh", "tan", "floordiv", "floormod"}),
    tensor_args=tensor_args,
    gathers_position_loads=False,
    array_module="torch",
    # Python ints, whose // floors; bounds that read no tensor are host code (attngen.plan._host_expressible).
    host_dialect=Dialect(
        functions={"min": "min", "max": "max"},
        where=lambda cond, if_true, if_false: f"({if_true} if {cond} else {if_false})",
        logical_not=lambda x: f"not {x}",
        to_float=lambda x: f"float({x})",
        floordiv=None,
        floormod=None,
        load=_no_tensor_on_the_host,
        clamp=_no_tensor_on_the_host,
    ),
)


# ----------------------------------------------------------------------------- tuned defaults
# Specs that do not pin their [triton] keys take them from a table of measured winners, per
# (GPU, head_dim, dtype), written by `attngen tune` (attngen/tune.py) and committed with the code,
# so that builds stay deterministic. A build targets the table's default_gpu.

TUNED_TABLE = Path(__file__).resolve().parent / "triton_tuned.toml"
_HEADER = (
    "# Triton kernel configurations measured fastest per (GPU, head_dim, dtype): written by\n"
    "# `attngen tune`, read by `attngen build` for specs that do not pin their [triton] keys.\n"
    "# A spec of head_dim D takes the entry of its dtype with the smallest head_dim >= D.\n"
)


@dataclass(frozen=True)
class TunedEntry:
    gpu: str
    head_dim: int
    dtype: str
    config: dict[str, int]  # TritonConfig fields (the rest: the backend's defaults)


def _load_table(path: Path | None = None) -> tuple[str, tuple[TunedEntry, ...]]:
    return _read_table(path or TUNED_TABLE)


@cache  # every spec parse asks for defaults: read the file once (write_tuned_table forgets it)
def _read_table(path: Path) -> tuple[str, tuple[TunedEntry, ...]]:
    with path.open("rb") as f:
        data = tomllib.load(f)
    return data["default_gpu"], tuple(
        TunedEntry(e.pop("gpu"), e.pop("head_dim"), e.pop("dtype"), e) for e in data["entry"]
    )


def default_config(head_dim: int, dtype: str) -> dict[str, int]:
    """[triton] values for a spec of this head_dim and dtype that does not set them."""
    gpu, entries = _load_table()
    fitting = [e for e in entries if e.gpu == gpu and e.dtype == dtype and e.head_dim >= head_dim]
    if not fitting:
        raise ValueError(f"{TUNED_TABLE.name} has no {gpu} entry for {dtype} with head_dim >= {head_dim}")
    return dict(min(fitting, key=lambda e: e.head_dim).config)


def write_tuned_table(new: list[TunedEntry], path: Path | None = None) -> None:
    """Merge `new` into the table (replacing entries of the same GPU, head_dim and dtype)."""
    path = path or TUNED_TABLE
    gpu, entries = _load_table(path)
    keys = {(e.gpu, e.head_dim, e.dtype) for e in new}
    merged = sorted(
        [e for e in entries if (e.gpu, e.head_dim, e.dtype) not in keys] + list(new),
        key=lambda e: (e.gpu, e.dtype, e.head_dim),
    )
    lines = [_HEADER, f"default_gpu = {json.dumps(gpu)}"]
    for e in merged:
        lines += [
            "",
            "[[entry]]",
            f"gpu = {json.dumps(e.gpu)}",
            f"head_dim = {e.head_dim}",
            f"dtype = {json.dumps(e.dtype)}",
        ]
        lines += [f"{key} = {int(value)}" for key, value in e.config.items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    _read_table.cache_clear()
