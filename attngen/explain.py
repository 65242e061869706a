"""`attngen explain`: what the compiler decided for one problem size, what it costs, and a picture.

Input: a Spec, a target, a problem size (batch, heads, lengths) and the runtime params the mask
reads. Output: an Explanation holding, per kernel of the target, the class of every
(q block, kv block) tile as the kernel runs it -- its compile-time bounds (attngen.analysis.tiles,
through attngen.plan) evaluated at these sizes, or the run-time block tables of masks that read
tensors at each position -- next to the tile's exact class from the dense mask; FLOPs, HBM
traffic and roofline times; and the bounds as expressions. `render` prints it, `write_png` draws it.

Goals:
  * ground truth: a tile's exact class comes from evaluating the mask's IR at every (query, key)
    pair (attngen.reference), never from the analysis it checks. A kernel class that skips a
    visible pair or runs a hidden pair unmasked is reported as unsound (a compiler bug); PARTIAL
    tiles that are in fact EMPTY or FULL are counted as the price of conservative bounds;
  * costs by the FlashAttention paper's IO accounting (Dao et al. 2022, section 3.2): each program
    reads its row block once, and the column block of every tile it visits from HBM; outputs are
    written once. Roofline time = max(FLOPs / peak, bytes / bandwidth).
Non-goals: measured times (bench/ measures); caches (an L2 hit still counts as HBM traffic); the
backward's small pre-pass (delta = rowsum(dO * O)) and GQA's dK/dV split reduction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path

import numpy as np

from attngen import ir
from attngen.analysis.tiles import BY_QUERY_BLOCK, TileBounds
from attngen.backends import TARGETS
from attngen.backends.base import Backend, Kernel
from attngen.backends.emit import emit
from attngen.errors import AttngenError
from attngen.plan import SPEC_DIALECT, kernel_tile_bounds, make_plan, spec_text
from attngen.png import encode
from attngen.reference import evaluate, positions
from attngen.spec import Spec

EMPTY, PARTIAL, FULL = 0, 1, 2  # as the run-time block tables number them
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}  # bytes per element of q, k, v and the outputs

# --------------------------------------------------------------------------- accelerators


@dataclass(frozen=True)
class Accelerator:
    """Published peaks of one chip: dense (not 2:4 sparse) bf16/fp16 matmul FLOP/s, HBM bytes/s."""

    label: str
    target: str  # the attngen target whose kernels run on it
    peak_flops: float
    bandwidth: float
    capability: int | None = None  # CUDA compute capability: the Triton module picks its forward by it


ACCELERATORS = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM): BF16 Tensor Core 1,979 TFLOPS with
    # sparsity, so 989 dense; GPU memory bandwidth 3.35 TB/s.
    "h100": Accelerator("H100 SXM", "triton_gpu", 989e12, 3.35e12, 90),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM): BF16 Tensor Core 1,979 TFLOPS with
    # sparsity, so 989 dense; GPU memory bandwidth 4.8 TB/s.
    "h200": Accelerator("H200 SXM", "triton_gpu", 989e12, 4.8e12, 90),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM): BF16 Tensor Core 312 TFLOPS
    # (624 with sparsity); GPU memory bandwidth 2,039 GB/s.
    "a100": Accelerator("A100 SXM 80GB", "triton_gpu", 312e12, 2.039e12, 80),
    # Google Cloud TPU documentation, "TPU v5e" system architecture: 197 TFLOPs bf16 peak compute
    # per chip; HBM2 bandwidth 819 GBps.
    "tpu-v5e": Accelerator("TPU v5e", "pallas_tpu", 197e12, 819e9),
    # Google Cloud TPU documentation, "TPU v6e" (Trillium) system architecture: 918 TFLOPs bf16
    # peak compute per chip; HBM bandwidth 1640 GBps.
    "tpu-v6e": Accelerator("TPU v6e", "pallas_tpu", 918e12, 1640e9),
}
DEFAULT_ACCELERATOR = {"triton_gpu": "h200", "pallas_tpu": "tpu-v6e"}

# --------------------------------------------------------------------------- the problem


@dataclass(frozen=True)
class Problem:
    """One call's sizes. The decode kernel answers new_tokens queries, the last positions of a
    cache of kv_len keys."""

    q_len: int
    kv_len: int
    batch: int = 1
    heads: int = 1
    kv_heads: int | None = None  # None: heads (no GQA)
    new_tokens: int = 1

    @property
    def groups(self) -> int:
        return self.kv_heads or self.heads


@dataclass(frozen=True)
class _Rows:
    """The queries a kernel's tiles hold: `count` of them at positions offset.., and the q_len the
    mask reads (the decode kernel's mask sees the whole cached sequence: q_len = kv_len)."""

    offset: int
    count: int
    q_len: int


# What each kernel computes, by the stem of its name in the backends' KERNELS (fwd_sm90 is a
# forward, bwd_dkdv_sm90 a dK/dV kernel). A kernel of another stem fails loudly (kind_of) rather
# than being costed as something it is not.
KINDS = {"fwd": "forward", "bwd_dq": "dq", "bwd_dkdv": "dkdv", "bwd_fused": "fused", "decode": "decode"}
# A kernel that does the work of several kinds: the fused backward, a dQ and a dK/dV kernel's.
SERVES = {"fused": ("dq", "dkdv")}


def kind_of(kernel: Kernel) -> str:
    """What `kernel` computes: "forward", "dq", "dkdv", "fused" (dq's and dkdv's work) or "decode"."""
    stems = [s for s in KINDS if kernel.name == s or kernel.name.startswith(f"{s}_")]
    if not stems:
        raise KeyError(f"attngen.explain does not know what kernel {kernel.name!r} computes: add it to KINDS")
    return KINDS[max(stems, key=len)]


def pair_flops(kind: str, head_dim: int, head_dim_v: int) -> int:
    """FLOPs per (query, key) pair of a tile: 2 per multiply-add of each matmul the kernel runs."""
    d, dv = head_dim, head_dim_v
    return {
        "forward": 2 * d + 2 * dv,  # S = Q K^T, O += P V
        "decode": 2 * d + 2 * dv,
        "dq": 2 * d + 2 * dv + 2 * d,  # S again, dP = dO V^T, dQ += dS K
        "dkdv": 2 * d + 2 * dv + 2 * dv + 2 * d,  # S, dP, dV += P^T dO, dK += dS^T Q
        "fused": 2 * d + 2 * dv + 2 * dv + 2 * d + 2 * d,  # dkdv's and dQ += dS K
    }[kind]


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Cost:
    flops_done: float  # visited tiles x tile FLOPs (a tail tile computes in full)
    flops_dense: float  # every tile visited: a kernel that skips nothing
    flops_useful: float  # visible pairs x pair FLOPs
    bytes_read: float
    bytes_written: float

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """FLOPs per byte of HBM traffic."""
        return self.flops_done / self.bytes if self.bytes else math.inf

    def time(self, chip: Accelerator) -> float:
        """Roofline seconds: the slower of computing and moving the data."""
        return max(self.flops_done / chip.peak_flops, self.bytes / chip.bandwidth)


@dataclass(frozen=True)
class TileMap:
    """One kernel at this problem size. Classes are [batch, heads, q blocks, kv blocks] in
    (query, key) orientation for every kernel, dK/dV's included."""

    kernel: Kernel
    kind: str
    block_q: int  # queries per tile
    block_kv: int  # keys per tile
    rows: _Rows
    bounds: TileBounds
    tables: bool  # whether the kernel walks run-time block tables instead of its bounds
    counted_on_host: bool  # whether the module evaluates its bounds on the host (plan.host_bounds)
    runs: np.ndarray  # what the kernel does with each tile
    exact: np.ndarray  # the tile's class from the dense mask
    visible_pairs: int
    pairs: int  # query-key pairs of the problem (batch x heads x queries x keys)
    cost: Cost
    dense: Cost  # the same kernel visiting every tile (no tile analysis)

    @property
    def tiles(self) -> int:
        return self.runs.size

    def count(self, cls: int, which: str = "runs") -> int:
        return int(np.count_nonzero(getattr(self, which) == cls))

    @property
    def skipped(self) -> float:
        return self.count(EMPTY) / self.tiles

    @property
    def unsound(self) -> int:
        """Tiles the kernel gets wrong: skipped with a visible pair, or run unmasked with a hidden one."""
        skips_visible = (self.runs == EMPTY) & (self.exact != EMPTY)
        unmasks_hidden = (self.runs == FULL) & (self.exact != FULL)
        return int(np.count_nonzero(skips_visible | unmasks_hidden))

    def conservative(self, cls: int) -> int:
        """Tiles run as PARTIAL that are in fact `cls` (EMPTY: a wasted visit; FULL: mask code run
        for nothing): the price of bounds that hold for every size and param."""
        return int(np.count_nonzero((self.runs == PARTIAL) & (self.exact == cls)))


@dataclass
class Explanation:
    spec: Spec
    target: str
    problem: Problem
    accelerator: str
    params: dict
    param_notes: list[str]
    maps: dict[str, TileMap]  # by kernel name, every kernel of the target
    launched: tuple[str, ...]  # the kernels a call runs on the accelerator (forward, backward, decode)
    not_launched: dict[str, str] = field(default_factory=dict)  # kernel name -> why not


# --------------------------------------------------------------------------- params


def resolve_params(spec: Spec, problem: Problem, given: dict[str, str], seed: int = 0) -> tuple[dict, list[str]]:
    """The params the mask reads: those given (NAME=VALUE strings, typed by the spec), the rest
    from attngen.testing.example_params (random tensors drawn with `seed`), each noted."""
    declared = {p.name: p for p in spec.params}
    for name in given:
        if name not in declared:
            raise AttngenError(f"{spec.name} has no param {name!r} (it declares {', '.join(declared) or 'none'})")
        if declared[name].is_tensor:
            raise AttngenError(f"param {name} is a tensor: it comes from attngen.testing.example_params (--seed)")
    params, notes = {}, []
    for name, text in given.items():
        cast = int if declared[name].type is ir.Type.INT else float
        try:
            params[name] = cast(text)
        except ValueError:
            raise AttngenError(f"param {name} is {declared[name].declared}, got {text!r}") from None
        notes.append(f"{name}={params[name]} (given)")
    needed = ir.variables(spec.mask) & declared.keys() if spec.mask is not None else set()
    missing = sorted(needed - params.keys())
    if missing:
        from attngen.testing import example_params

        examples = example_params(spec.name, problem.batch, problem.heads, problem.q_len, problem.kv_len, seed)
        if not set(missing) <= examples.keys():
            raise AttngenError(f"the mask reads {', '.join(missing)}: pass --params NAME=VALUE for each")
        for name in missing:
            params[name] = examples[name]
            value = f"random {declared[name].declared}, seed {seed}" if declared[name].is_tensor else examples[name]
            notes.append(f"{name}={value} (from attngen.testing.example_params)")
    for name in ir.divisor_params(spec.mask) if spec.mask is not None else ():
        if params[name] <= 0:  # the generated functions refuse it too
            raise AttngenError(f"param {name} divides in the mask: it must be positive, got {params[name]}")
    return params, notes


# --------------------------------------------------------------------------- tile classes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Mask values evaluated per band of query rows: bounds memory at any length (int64 temporaries).
_BAND_PAIRS = 1 << 22


def _visible_counts(spec: Spec, params: dict, problem: Problem, rows: _Rows, step_q: int, step_kv: int) -> np.ndarray:
    """Visible pairs per [step_q, step_kv] cell: [batch | 1, heads | 1, q cells, kv cells] (1 where
    the mask reads neither b nor h). The mask is evaluated from its IR by attngen.reference, a band
    of rows at a time; positions past the lengths count as hidden."""
    kv_len = problem.kv_len
    cells_kv = _cdiv(kv_len, step_kv)
    env = {**positions(problem.batch, problem.heads, rows.count, kv_len), "q_len": rows.q_len, **params}
    band = step_q * max(1, _BAND_PAIRS // (step_q * kv_len * problem.batch * problem.heads))
    counts = []
    for start in range(0, rows.count, band):
        stop = min(start + band, rows.count)
        q_idx = np.arange(start, stop).reshape(1, 1, -1, 1) + rows.offset
        if spec.mask is None:
            visible = np.ones((1, 1, stop - start, kv_len), dtype=bool)
        else:
            visible = evaluate(spec.mask, {**env, "q_idx": q_idx})
            visible = np.broadcast_to(visible, np.broadcast_shapes(visible.shape, (1, 1, stop - start, kv_len)))
        padded = _cdiv(stop - start, step_q) * step_q
        visible = np.pad(visible, ((0, 0), (0, 0), (0, padded - (stop - start)), (0, cells_kv * step_kv - kv_len)))
        shape = visible.shape[:2]
        counts.append(visible.reshape(*shape, padded // step_q, step_q, cells_kv, step_kv).sum(axis=(3, 5)))
    shape = np.broadcast_shapes(*(c.shape[:2] for c in counts))
    return np.concatenate([np.broadcast_to(c, (*shape, *c.shape[2:])) for c in counts], axis=2)


def _coarsen(counts: np.ndarray, factor_q: int, factor_kv: int) -> np.ndarray:
    """Sums over groups of factor_q x factor_kv cells (the last group of each axis may be short)."""
    *lead, cq, ck = counts.shape
    pad_q, pad_kv = _cdiv(cq, factor_q) * factor_q - cq, _cdiv(ck, factor_kv) * factor_kv - ck
    counts = np.pad(counts, ((0, 0), (0, 0), (0, pad_q), (0, pad_kv)))
    return counts.reshape(*lead, (cq + pad_q) // factor_q, factor_q, (ck + pad_kv) // factor_kv, factor_kv).sum((3, 5))


def _in_range(length: int, block: int) -> np.ndarray:
    """Positions inside the sequence in each block of `block` positions."""
    starts = np.arange(_cdiv(length, block)) * block
    return np.minimum(block, length - starts)


def _exact_classes(counts: np.ndarray, rows_in: np.ndarray, cols_in: np.ndarray, walks_keys: bool) -> np.ndarray:
    """Tile classes from visible-pair counts. FULL means no mask code is needed: every pair inside
    the sequences visible, and no padding along the axis the kernel's loop walks (a tail block of
    it must be masked whatever the mask says; a tail row block is simply not stored)."""
    in_range = rows_in[:, None] * cols_in[None, :]
    walked = cols_in if walks_keys else rows_in
    block = walked.max()
    complete = (walked == block)[None, :] if walks_keys else (walked == block)[:, None]
    full = (counts == in_range) & complete
    return np.where(counts == 0, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)


def _table_classes(counts: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """The run-time block tables' classes (templates: _tile_classes): positions past the lengths
    are hidden pairs there, so a tail tile is never FULL."""
    return np.where(counts == 0, EMPTY, np.where(counts == block_q * block_kv, FULL, PARTIAL)).astype(np.int8)


def _bound_classes(
    bounds: TileBounds, kernel: Kernel, problem: Problem, rows: _Rows, params: dict, block_q: int, block_kv: int
) -> np.ndarray:
    """The classes the kernel's compile-time bounds give, evaluated as the templates evaluate them:
    each row block's first and last position (the last clamped to the length), then lo, hi,
    full_lo, full_hi in order, each reading those before it."""
    walk = kernel.walks
    by_query = walk is BY_QUERY_BLOCK
    if not by_query and rows.offset:
        raise NotImplementedError("a kernel walking query blocks over offset queries")
    row_block, col_block = (block_q, block_kv) if by_query else (block_kv, block_q)
    row_len, col_len = (rows.count, problem.kv_len) if by_query else (problem.kv_len, rows.count)
    first = np.arange(_cdiv(row_len, row_block)).reshape(1, 1, -1) * row_block
    last = np.minimum(first + row_block, row_len) - 1
    index = positions(problem.batch, problem.heads, 1, 1)
    env = {
        "b": index["b"][..., 0],  # [batch, 1, 1]: broadcasts against row blocks
        "h": index["h"][..., 0],
        "q_len": rows.q_len,
        "kv_len": problem.kv_len,
        kernel.step: col_block,  # a symbolic step (Triton's BLOCK_N) reads the block it names
        **params,
        walk.names["row_first"]: first + (rows.offset if by_query else 0),
        walk.names["row_last"]: last + (rows.offset if by_query else 0),
    }
    for key, expr in (("col_lo", bounds.lo), ("col_hi", bounds.hi), ("full_lo", bounds.full_lo)):
        env[walk.names[key]] = evaluate(expr, env)
    full_hi = evaluate(bounds.full_hi, env)
    lo, hi, full_lo = (env[walk.names[key]] for key in ("col_lo", "col_hi", "full_lo"))
    column = np.arange(_cdiv(col_len, col_block))
    bounds_of = lambda x: np.broadcast_to(x, (problem.batch, problem.heads, len(first[0, 0])))[..., None]
    visit = (bounds_of(lo) <= column) & (column < bounds_of(hi))
    full = visit & (bounds_of(full_lo) <= column) & (column < bounds_of(full_hi))
    classes = np.where(visit, np.where(full, FULL, PARTIAL), EMPTY).astype(np.int8)
    return classes if by_query else classes.swapaxes(2, 3)


# --------------------------------------------------------------------------- costs


def _cost(kind: str, spec: Spec, problem: Problem, runs: np.ndarray, visible: int, bq: int, bk: int, rows: _Rows):
    """FLOPs and HBM bytes of one kernel (module docstring: the FlashAttention IO accounting)."""
    d, dv, item = spec.head_dim, spec.value_dim, ITEMSIZE[spec.dtype]
    per_pair = pair_flops(kind, d, dv)
    visited = runs != EMPTY
    tile_flops = bq * bk * per_pair
    b, h, q, kv = problem.batch, problem.heads, rows.count, problem.kv_len
    lse = 4  # float32 per query row (LSE; delta likewise)
    keys_in, queries_in = _in_range(kv, bk), _in_range(q, bq)
    # The column block of each visited tile, in positions inside the sequence.
    keys_visited = float((visited * keys_in[None, None, None, :]).sum())
    queries_visited = float((visited * queries_in[None, None, :, None]).sum())
    if kind in ("forward", "decode"):  # per q block: Q once; per tile: K, V; out: O, LSE
        read = b * h * q * d * item + keys_visited * (d + dv) * item
        written = b * h * q * (dv * item + lse)
    elif kind == "dq":  # per q block: Q, dO, LSE, delta once; per tile: K, V; out: dQ
        read = b * h * q * ((d + dv) * item + 2 * lse) + keys_visited * (d + dv) * item
        written = b * h * q * d * item
    else:  # dkdv, per kv block of a kv head: K, V once; per tile of each of its query heads: Q, dO, LSE, delta
        read = b * problem.groups * kv * (d + dv) * item + queries_visited * ((d + dv) * item + 2 * lse)
        written = b * problem.groups * kv * (d + dv) * item
        if kind == "fused":  # and before it delta from O and dO; per tile dQ's float32 share added; dQ converted
            read += b * h * q * 2 * dv * item + b * h * q * d * 4
            written += b * h * q * lse + queries_visited * d * 4 + b * h * q * d * item
    return Cost(
        flops_done=float(visited.sum()) * tile_flops,
        flops_dense=float(runs.size) * tile_flops,
        flops_useful=float(visible) * per_pair,
        bytes_read=read,
        bytes_written=written,
    )


# --------------------------------------------------------------------------- explain


def _tile_shape(config, kernel: Kernel, rows: _Rows) -> tuple[int, int]:
    """(queries, keys) per tile of `kernel`: a Triton config names each kernel's tiles
    (TritonConfig.tiles); a Pallas config has one block_q x block_kv, and its decode kernel
    holds every new token of a kv head in one tile."""
    if hasattr(config, "tiles"):
        tiles = config.tiles(kernel)
        return tiles["block_m"], tiles["block_n"]
    return (rows.count if kind_of(kernel) == "decode" else config.block_q), config.block_kv


def _backend(target: str) -> Backend:
    names = {t.name: t for t in TARGETS}
    if target not in names:
        raise AttngenError(f"no target {target!r}; targets: {', '.join(names)}")
    return names[target]


def explain(
    spec: Spec,
    problem: Problem,
    target: str = "triton_gpu",
    params: dict[str, str] | None = None,
    seed: int = 0,
    accelerator: str | None = None,
) -> Explanation:
    """Every kernel of `target` at `problem`: tile classes (run and exact), costs, bounds."""
    backend = _backend(target)
    accelerator = accelerator or DEFAULT_ACCELERATOR[target]
    if accelerator not in ACCELERATORS or ACCELERATORS[accelerator].target != target:
        runs_it = [n for n, a in ACCELERATORS.items() if a.target == target]
        raise AttngenError(f"{target} kernels run on {', '.join(runs_it)}, not {accelerator!r}")
    if min(problem.q_len, problem.kv_len, problem.batch, problem.heads, problem.new_tokens) < 1:
        raise AttngenError("lengths, batch, heads and new tokens must be positive")
    if problem.heads % problem.groups or problem.new_tokens > problem.kv_len:
        raise AttngenError("kv heads must divide heads, and new tokens be at most kv_len")
    values, notes = resolve_params(spec, problem, params or {}, seed)
    plan = make_plan(spec, backend, spec.path)  # whether the kernels walk run-time block tables
    all_bounds = kernel_tile_bounds(spec, backend)
    training = _Rows(0, problem.q_len, problem.q_len)
    decode = _Rows(problem.kv_len - problem.new_tokens, problem.new_tokens, problem.kv_len)
    rows_of = {k.name: decode if kind_of(k) == "decode" else training for k in backend.kernels}
    shapes = {k.name: _tile_shape(plan.config, k, rows_of[k.name]) for k in backend.kernels}
    # One evaluation of the mask per row geometry, at the finest cells every tile is made of.
    fine = {}
    for rows in {training, decode}:
        sizes = [shapes[k.name] for k in backend.kernels if rows_of[k.name] == rows]
        cell = (reduce(math.gcd, (s[0] for s in sizes)), reduce(math.gcd, (s[1] for s in sizes)))
        fine[rows] = (cell, _visible_counts(spec, values, problem, rows, *cell))
    maps = {}
    order = list(KINDS.values())  # forwards first, then dQ, dK/dV and decode; declared order within
    for k in sorted(backend.kernels, key=lambda k: order.index(kind_of(k))):
        kind, rows, (bq, bk) = kind_of(k), rows_of[k.name], shapes[k.name]
        (cq, ck), cells = fine[rows]
        counts = np.broadcast_to(
            _coarsen(cells, bq // cq, bk // ck),
            (problem.batch, problem.heads, _cdiv(rows.count, bq), _cdiv(problem.kv_len, bk)),
        )
        exact = _exact_classes(
            counts, _in_range(rows.count, bq), _in_range(problem.kv_len, bk), k.walks is BY_QUERY_BLOCK
        )
        # Masks that read tensors at each position have run-time block tables, except in the
        # decode kernels: they walk their bounds (which then visit every tile).
        tables = plan.block_tables and kind != "decode"
        if tables:
            runs = _table_classes(counts, bq, bk)
        else:
            runs = _bound_classes(all_bounds[k.name], k, problem, rows, values, bq, bk)
        visible = int(counts.sum())
        maps[k.name] = TileMap(
            kernel=k,
            kind=kind,
            block_q=bq,
            block_kv=bk,
            rows=rows,
            bounds=all_bounds[k.name],
            tables=tables,
            counted_on_host=k.name in plan.host_bounds,
            runs=runs,
            exact=exact,
            visible_pairs=visible,
            pairs=problem.batch * problem.heads * rows.count * problem.kv_len,
            cost=_cost(kind, spec, problem, runs, visible, bq, bk, rows),
            dense=_cost(kind, spec, problem, np.full_like(runs, PARTIAL), visible, bq, bk, rows),
        )
    explanation = Explanation(spec, target, problem, accelerator, values, notes, maps, ())
    explanation.launched, explanation.not_launched = launched_kernels(explanation, ACCELERATORS[accelerator])
    return explanation


def launched_kernels(ex: Explanation, chip: Accelerator) -> tuple[tuple[str, ...], dict[str, str]]:
    """(the kernel of each kind a call runs on `chip`, {each other kernel: why not}), picked as the
    generated module picks (templates/triton_gpu/module.py.jinja): a kernel built for the chip's
    compute capability when it is on and the call's programs are not short (sm90_forward_min_keys,
    sm90_fused_min_queries), else the short-sequence forward up to short_kv_len keys, else the plain
    kernel."""
    config = ex.spec.config(ex.target)

    def why_not(kernel: Kernel) -> str | None:
        if kernel.capabilities and chip.capability not in kernel.capabilities:
            return f"built for compute capability {'/'.join(map(str, kernel.capabilities))}"
        if kernel.family == "fp8":
            return "attention_fp8's kernel (FP8 inputs), not attention's"
        if kernel.name == "fwd_sm90" and config.sm90_forward and config.sm90_forward_min_keys:
            keys = _keys_seen(ex, ex.maps[kernel.name])
            if keys is not None and keys <= config.sm90_forward_min_keys:
                return f"its middle row block sees {keys} keys, at most sm90_forward_min_keys = {config.sm90_forward_min_keys}"
        if kernel.enabled_by == "short_kv_len":  # a length, not a switch
            return None if ex.problem.kv_len <= config.short_kv_len else f"only up to {config.short_kv_len} keys"
        if kernel.enabled_by and not getattr(config, kernel.enabled_by):
            return f"off ({kernel.enabled_by} = 0)"
        if kernel.name == "bwd_fused_sm90" and ex.problem.q_len <= config.sm90_fused_min_queries:
            return f"{ex.problem.q_len} queries, at most sm90_fused_min_queries = {config.sm90_fused_min_queries}"
        return None

    chosen, skipped = {}, {}
    # The most specialised first, a kernel serving several kinds before each of theirs.
    preference = lambda k: (not k.capabilities, not k.enabled_by, kind_of(k) not in SERVES)
    for kernel in sorted((m.kernel for m in ex.maps.values()), key=preference):
        kind = kind_of(kernel)
        if kind in chosen:
            skipped[kernel.name] = f"{chosen[kind]} serves this call"
            if kind == "dq" and ex.spec.grad_params and not kernel.capabilities:  # (_backward's rule)
                skipped[kernel.name] += ", and every call whose [grad] params want gradients (it gathers them)"
            if kind_of(ex.maps[chosen[kind]].kernel) in SERVES and kernel.capabilities:  # (_backward's rule)
                trained = " or one whose [grad] params want gradients" if ex.spec.grad_params and kind == "dkdv" else ""
                skipped[kernel.name] += (
                    f"; a deterministic call (torch.use_deterministic_algorithms){trained} runs this one"
                )
        elif (reason := why_not(kernel)) is not None:
            skipped[kernel.name] = reason
        else:
            for served in SERVES.get(kind, (kind,)):
                chosen[served] = kernel.name
    launched = tuple(name for name in ex.maps if name in chosen.values())
    return launched, {name: skipped[name] for name in ex.maps if name in skipped}


def _keys_seen(ex: Explanation, m: TileMap) -> int | None:
    """The keys the Hopper forward's middle row block sees, as the generated module counts them
    (_sm90_keys_seen, from the tile bounds on the host); None where it counts none (block tables,
    bounds the host cannot evaluate)."""
    if not m.counted_on_host:
        return None
    row = ex.problem.q_len // 2 // m.block_q
    return int(np.count_nonzero(m.runs[0, 0, row] != EMPTY)) * m.block_kv


# --------------------------------------------------------------------------- text


def bounds_text(bounds: TileBounds, kernel: Kernel) -> list[str]:
    """The four bounds in the spec language, one `name = expression` line each."""
    names = kernel.walks.names
    lines = []
    for key, expr in (("col_lo", bounds.lo), ("col_hi", bounds.hi), ("full_lo", bounds.full_lo), ("full_hi", None)):
        expr = expr if expr is not None else bounds.full_hi
        name = names[key] if key != "full_hi" else names["full_lo"].replace("full_lo", "full_hi")
        lines.append(f"{name} = {emit(expr, SPEC_DIALECT, {v: v for v in ir.variables(expr)})}")
    return lines


# What a tile shows: the kernel's class, and whether the exact class differs.
_SHOWN = {  # (runs, exact) -> (character, RGB, legend); anything else is unsound
    (EMPTY, EMPTY): (".", (255, 255, 255), "EMPTY: skipped"),
    (FULL, FULL): ("█", (31, 78, 121), "FULL: no mask code"),
    (PARTIAL, PARTIAL): ("░", (242, 142, 43), "PARTIAL: masked"),
    (PARTIAL, EMPTY): ("e", (252, 211, 170), "run as PARTIAL, EMPTY in fact (a wasted visit)"),
    (PARTIAL, FULL): ("f", (132, 176, 218), "run as PARTIAL, FULL in fact (mask code for nothing)"),
}
_UNSOUND = ("!", (214, 39, 40), "UNSOUND: skips a visible pair or runs a hidden one unmasked (a bug)")
_MIXED = ("▒", (170, 170, 170), "mixed: tiles of several kinds in one cell (downsampled, or differing by batch/head)")
_SYMBOLS = [*_SHOWN.values(), _UNSOUND, _MIXED]


def _cells(tile_map: TileMap, max_rows: int, max_cols: int) -> tuple[np.ndarray, tuple[int, int]]:
    """Index into _SYMBOLS per cell, each cell a group of tiles (over every batch and head) at most
    max_rows x max_cols cells; and the group's size (1, 1 when not downsampled)."""
    runs, exact = tile_map.runs, tile_map.exact
    symbol = np.full(runs.shape, _SYMBOLS.index(_UNSOUND), dtype=np.int8)
    for i, pair in enumerate(_SHOWN):
        symbol[(runs == pair[0]) & (exact == pair[1])] = i
    nq, nk = runs.shape[2:]
    fq, fk = _cdiv(nq, max_rows), _cdiv(nk, max_cols)
    # Any unsound tile marks its cell; a cell of one kind shows it; else it is mixed.
    groups = np.pad(symbol, ((0, 0), (0, 0), (0, _cdiv(nq, fq) * fq - nq), (0, _cdiv(nk, fk) * fk - nk)), mode="edge")
    groups = groups.reshape(*runs.shape[:2], _cdiv(nq, fq), fq, _cdiv(nk, fk), fk).transpose(2, 4, 0, 1, 3, 5)
    groups = groups.reshape(*groups.shape[:2], -1)
    cell = np.where((groups == groups[..., :1]).all(-1), groups[..., 0], _SYMBOLS.index(_MIXED))
    cell = np.where((groups == _SYMBOLS.index(_UNSOUND)).any(-1), _SYMBOLS.index(_UNSOUND), cell)
    return cell, (fq, fk)


def _si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def _seconds(t: float) -> str:
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.3g} ms"


def render(ex: Explanation, text_rows: int = 24, text_cols: int = 80) -> str:
    """The explanation as text: summary, tile classes, costs, bounds and text tile maps."""
    p, spec, chip = ex.problem, ex.spec, ACCELERATORS[ex.accelerator]
    kv = f", kv heads {p.groups}" if p.groups != p.heads else ""
    dims = f"head_dim {spec.head_dim}" + (f" (v: {spec.value_dim})" if spec.value_dim != spec.head_dim else "")
    sizes = f"batch {p.batch}, heads {p.heads}{kv}, q_len {p.q_len}, kv_len {p.kv_len}, {dims}, {spec.dtype}"
    out = [
        f"{spec.name} on {ex.target}: {sizes}",
        f"mask: {spec_text(spec, 'mask')}",
        f"params: {'; '.join(ex.param_notes) or 'none read by the mask'}",
    ]
    tables = [n for n, m in ex.maps.items() if m.tables]
    if tables:
        out.append(f"tiles: {', '.join(tables)} walk run-time block tables (the mask reads tensors at each position)")
    out.append("tiles: compile-time bounds evaluated at these sizes" + (" for the rest" if tables else ""))
    out.append("every tile checked against its exact class from the dense mask (attngen.reference)")
    out += [
        "",
        f"kernels (* launched on {chip.label}; decode: {p.new_tokens} new token(s) after {p.kv_len - p.new_tokens} cached):",
    ]
    header = f"  {'kernel':<15}{'tile q x kv':>12}{'grid':>12}{'EMPTY':>9}{'PARTIAL':>9}{'FULL':>9}{'skipped':>9}"
    out.append(header + f"{'PARTIAL but EMPTY/FULL':>24}{'unsound':>9}")
    for name, m in ex.maps.items():
        mark = "*" if name in ex.launched else " "
        grid = f"{m.runs.shape[2]} x {m.runs.shape[3]}"
        out.append(
            f"{mark} {name:<15}{f'{m.block_q} x {m.block_kv}':>12}{grid:>12}{m.count(EMPTY):>9}{m.count(PARTIAL):>9}"
            f"{m.count(FULL):>9}{m.skipped:>9.1%}{f'{m.conservative(EMPTY)} / {m.conservative(FULL)}':>24}{m.unsound:>9}"
        )
    for name, why in ex.not_launched.items():
        out.append(f"  ({name} not launched on {chip.label}: {why})")
    for name, m in ex.maps.items():
        if m.unsound:
            out.append(
                f"  BUG: {name} gets {m.unsound} tile(s) wrong (skips a visible pair or runs a hidden one unmasked)"
            )
    out += [
        "",
        f"costs on {chip.label} (FlashAttention IO accounting, no cache reuse; roofline = max(FLOPs / peak, bytes / bandwidth)):",
    ]
    out.append(
        f"  {'kernel':<15}{'FLOPs done':>12}{'if dense':>12}{'useful':>12}{'HBM read':>12}{'written':>11}"
        f"{'FLOP/byte':>11}{'roofline':>11}{'if dense':>11}"
    )
    for name in ex.launched:
        m = ex.maps[name]
        c = m.cost
        out.append(
            f"  {name:<15}{_si(c.flops_done, 'F'):>12}{_si(c.flops_dense, 'F'):>12}{_si(c.flops_useful, 'F'):>12}"
            f"{_si(c.bytes_read, 'B'):>12}{_si(c.bytes_written, 'B'):>11}{c.intensity:>11.0f}"
            f"{_seconds(c.time(chip)):>11}{_seconds(m.dense.time(chip)):>11}"
        )
    out += [
        "",
        "training step (forward + backward) by accelerator: roofline time, and a dense kernel's (no tile skipped):",
    ]
    for other in ACCELERATORS.values():
        if other.target != ex.target:
            continue
        names = launched_kernels(ex, other)[0]
        names = [n for n in names if ex.maps[n].kind != "decode"]
        time = sum(ex.maps[n].cost.time(other) for n in names)
        dense = sum(ex.maps[n].dense.time(other) for n in names)
        out.append(
            f"  {other.label:<14} {_seconds(time):>10} vs {_seconds(dense):>10} dense ({dense / time:.2f}x)"
            f"  [{', '.join(names)}; {other.peak_flops / 1e12:.0f} TFLOP/s, {other.bandwidth / 1e12:.2f} TB/s]"
        )
    if spec.dtype == "float32":
        out.append("  (peaks are bf16/fp16 matmul rates: a float32 spec runs slower than shown)")
    out += ["", "closed-form bounds (column blocks [lo, hi) visited per row block, [full_lo, full_hi) FULL):"]
    shown = {}
    for name, m in ex.maps.items():
        if not m.tables:
            shown.setdefault(id(m.bounds), (m, []))[1].append(name)
    for m, names in shown.values():
        by_query = m.kernel.walks is BY_QUERY_BLOCK
        walk = "kv blocks per q block" if by_query else "q blocks per kv block"
        blocks = ", ".join(f"{n} {ex.maps[n].block_kv if by_query else ex.maps[n].block_q}" for n in names)
        reads_step = any(m.kernel.step in ir.variables(e) for e in (m.bounds.lo, m.bounds.hi, m.bounds.full_hi))
        step = f"{m.kernel.step} = {blocks}" if reads_step else f"{m.kernel.step} inlined: {blocks}"
        affine = "" if m.bounds.affine else "; some of the mask has no closed form: its tiles run masked"
        out.append(f"  {walk} ({step}{affine}):")
        out += [f"    {line}" for line in bounds_text(m.bounds, m.kernel)]
    # Text maps of every launched kernel when they fit as they are; else the forward's alone,
    # downsampled (the PNG has them all).
    small = all(
        max(ex.maps[n].runs.shape[2] / text_rows, ex.maps[n].runs.shape[3] / text_cols) <= 1 for n in ex.launched
    )
    drawn = ex.launched if small else ex.launched[:1]
    out += ["", "tile maps (rows: query blocks, top first; columns: key blocks, left first):"]
    out += [f"  {c} {legend}" for c, _, legend in _SYMBOLS]
    for name in drawn:
        m = ex.maps[name]
        cells, (fq, fk) = _cells(m, text_rows, text_cols)
        scale = f", downsampled: a character is {fq} x {fk} tiles" if (fq, fk) != (1, 1) else ""
        out += ["", f"{name} ({m.block_q} x {m.block_kv} tiles{scale}):"]
        out += ["  " + "".join(_SYMBOLS[i][0] for i in row) for row in cells]
    if not small:
        out += ["", f"(text maps of {', '.join(ex.launched[1:])} left out at this size: the PNG draws every kernel)"]
    return "\n".join(out)


# --------------------------------------------------------------------------- PNG


def write_png(ex: Explanation, path: Path, max_cells: int = 512, panel_pixels: int = 512, gap: int = 16) -> Path:
    """The launched kernels' tile maps side by side (forward, dQ, dK/dV, decode, as `render` lists
    them), top-aligned on a light grey background. One block of pixels per tile (per group of
    tiles past max_cells a side), shaped like the tile in positions so that every panel draws the
    mask at the same slope; the larger side of a panel is about panel_pixels. Colours: _SYMBOLS."""
    panels = []
    for name in ex.launched:
        m = ex.maps[name]
        cells, (fq, fk) = _cells(m, max_cells, max_cells)
        span_q, span_kv = m.block_q * fq, m.block_kv * fk  # positions per cell
        scale = panel_pixels / max(cells.shape[0] * span_q, cells.shape[1] * span_kv)  # pixels per position
        cell_h, cell_w = max(1, round(span_q * scale)), max(1, round(span_kv * scale))
        cell_h = max(cell_h, _cdiv(gap, cells.shape[0]))  # a decode strip of one row stays visible
        colours = np.array([rgb for _, rgb, _ in _SYMBOLS], dtype=np.uint8)[cells]
        panels.append(colours.repeat(cell_h, axis=0).repeat(cell_w, axis=1))
    height = max(p.shape[0] for p in panels) + 2 * gap
    width = sum(p.shape[1] for p in panels) + gap * (len(panels) + 1)
    image = np.full((height, width, 3), 235, dtype=np.uint8)
    x = gap
    for panel in panels:
        image[gap : gap + panel.shape[0], x : x + panel.shape[1]] = panel
        x += panel.shape[1] + gap
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode(width, height, image.tobytes()))
    return path
