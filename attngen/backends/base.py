"""What a target is: its config table, its kernels, its templates and how it spells expressions.

A target owns everything about itself that the rest of attngen reads: the keys of its table in
a spec ([triton], [pallas_tpu]) with their defaults and checks, the list of its kernels (each
declared once, here, for the plan, the templates, `attngen check`, `attngen tune` and the tests),
and its expression dialect. spec/, plan.py and build.py know targets only through this
interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from attngen.analysis.tiles import Orientation
from attngen.backends.emit import Dialect


def power_of_two_at_least(n: int) -> int:
    """The smallest power of two >= n (n >= 1): a head dim as the kernels' tiles hold it (Triton's
    tl.arange and Gluon's tensors need powers of two)."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class ProblemShape:
    """What a target's config may depend on: the spec's head dims and dtype, whether its backward
    writes a trained tensor's gradient per (query, key) pair ([grad] of a full bias) or sums it
    along diagonals ([grad] of a relative table), whether its score reads a tensor at each pair
    (a full bias, trained or not: ir.reads_pairs), whether it has a mask or a score at all, and
    whether it is the causal mask alone (q_idx >= kv_idx, no score)."""

    head_dim: int
    head_dim_v: int
    dtype: str
    per_pair_grads: bool = False
    relative_grads: bool = False
    pair_reads: bool = False
    plain: bool = False  # no mask, no score: softmax(q k^T * scale) v
    causal: bool = False  # the mask q_idx >= kv_idx and no score

    @property
    def widest(self) -> int:
        return max(self.head_dim, self.head_dim_v)


class Report(Protocol):
    """Where a target's config check reports a problem: at `key` of its table (None: the table)."""

    def __call__(self, message: str, key: str | None = None, hint: str | None = None) -> None: ...


class Counted:
    """A Report that counts the problems it passes on: a config check gives None if any."""

    def __init__(self, report: Report):
        self.report, self.count = report, 0

    def __call__(self, message: str, key: str | None = None, hint: str | None = None) -> None:
        self.count += 1
        self.report(message, key, hint)


@dataclass(frozen=True)
class Arg:
    """A runtime argument of a GPU kernel, as a launch on contiguous inputs specialises it.

    kind: "desc" a tensor descriptor over [batch, heads, seq, head_dim] moving [rows, width]
    tiles (rows: the kernel's constexpr naming them; width: "d" head_dim, "dv" head_dim_v, "d_half"
    half of head_dim (a consumer's columns), or a constexpr's name); "nvmma_desc" the same for a
    Gluon kernel, into NVMMA-swizzled shared memory (wgmma's operand layout); "*in" a pointer to the
    spec's dtype; a Triton type: "*fp32", "*i32" (pointers), "i32", "fp32"; or "none": a tensor that
    other launches of the same function take, None in this one. element: a descriptor's element type
    when it is not the spec's dtype ("float8_e4m3fn", "float32"). divisible: the value is a multiple
    of 16 (a pointer: 16-byte aligned), which the compiler may assume.
    """

    kind: str
    rows: str = ""
    width: str = "d"
    divisible: bool = False
    element: str = ""

    @property
    def is_tensor(self) -> bool:
        return self.kind.endswith("desc") or self.kind.startswith("*") or self.kind == "none"


def desc(rows: str, width: str = "d") -> Arg:
    return Arg("desc", rows, width)


F32_POINTER = Arg("*fp32", divisible=True)
I32_POINTER = Arg("*i32", divisible=True)
INPUT_POINTER = Arg("*in", divisible=True)  # a pointer to the spec's dtype (q, k, v, out)
NOT_PASSED = Arg("none")
FP8 = "float8_e4m3fn"  # the element type of attention_fp8's inputs (torch's name)
I32 = Arg("i32")
FP32 = Arg("fp32")
# The arguments every attention kernel takes after its tensors.
PROBLEM_ARGS = (("num_heads", Arg("i32", divisible=True)), ("q_len", I32), ("kv_len", I32), ("scale", FP32))


@dataclass(frozen=True)
class Kernel:
    """One kernel of a target, declared once: the plan gives it tile bounds, its template defines
    it, `attngen check` compiles it, `attngen tune` times it, the tests name it.

    A kernel that serves several tile configurations (the forward's short-sequence tiles) is
    declared once per configuration, under the same function.
    """

    name: str  # how reports and the tuned table name it: "fwd", "fwd_short", "bwd_dq", ...
    family: str  # the kernels that serve one entry point together: "training" (attention, its backward)
    function: str  # its function in the generated module
    template: str  # the template file that defines it, under templates/<target>/
    about: str  # one line for generated code and reports: what it computes, what its tiles are
    walks: Orientation  # which tile bounds its loop reads: kv blocks per q block, or q blocks per kv block
    step: str  # the block size its loop steps by: a config key, or a constexpr name (see Backend.symbolic_blocks)
    tiles: str = ""  # its keys' prefix in the config table (Triton: "", "short_", "dq_", "dkdv_")
    # GPU kernels: the runtime arguments, by name, in order; the spec's params (and block tables)
    # follow them. The template renders the signature from this list, and `attngen check`
    # specialises each argument by its declaration.
    arguments: tuple[tuple[str, Arg], ...] = ()
    # Constexprs fixed when compiling ahead of time without a launch (GQA group of 1, no split).
    constexprs: tuple[tuple[str, int], ...] = ()
    # When a kernel serves only some launches (the short forward): the config key that turns it on.
    enabled_by: str | None = None
    language: str = "triton"  # or "gluon": Triton's lower-level language (layouts, warp specialization)
    # The CUDA compute capabilities it is built for (90: Hopper); () for every GPU.
    capabilities: tuple[int, ...] = ()

    def argument(self, name: str) -> Arg | None:
        return dict(self.arguments).get(name)

    @property
    def tensor_names(self) -> str:
        """The declared tensor arguments (descriptors, pointers) as a signature spells them."""
        return ", ".join(name for name, arg in self.arguments if arg.is_tensor)

    @property
    def scalar_names(self) -> str:
        """The declared scalar arguments as a signature spells them: "num_heads, q_len, ..."."""
        return ", ".join(name for name, arg in self.arguments if not arg.is_tensor)


@dataclass(frozen=True)
class Backend:
    name: str  # e.g. "triton_gpu"; also the module name in the generated package
    template: str  # the module's template under templates/ (it includes each kernel's template)
    dialect: Dialect  # templates name q_idx, kv_idx, b, h, score and the tile variables as the IR does
    param_prefix: str  # kernels read param `x` as f"{param_prefix}{x}" (never shadows a name)
    kernels: tuple[Kernel, ...]
    # The spec's table for this target, e.g. "triton": its keys and their types (int only today).
    config_table: str
    config_keys: tuple[str, ...]
    # (the table's values, the spec's shape, where to report) -> the config object the plan and
    # templates read, with unset keys defaulted; problems go to `report` and give None, and so
    # does a shape of None (a spec with other problems: the values are checked, nothing more).
    make_config: Callable[[dict[str, int], ProblemShape | None, Report], Any]
    # Whether the kernels take their block sizes as compile-time arguments (Triton constexprs):
    # then tile bounds read a kernel's `step` as a name and one kernel serves every tile size.
    symbolic_blocks: bool
    helper_functions: frozenset[str]  # dialect functions the template defines only when used
    # What a kernel takes for a tensor param: (its name in kernels, its rank) -> argument names.
    tensor_args: Callable[[str, int], tuple[str, ...]]
    # Whether loads at per-position indices (q_idx, kv_idx) are materialised before the kernels
    # into score-shaped tiles (TPUs have no general gather), rather than read in the kernels.
    gathers_position_loads: bool
    array_module: str  # what the generated module calls its array library: "torch", "jnp"
    # How the module's host code spells tile bounds it evaluates itself (to choose a kernel by the
    # keys a program sees); None: it evaluates none.
    host_dialect: Dialect | None = None

    @property
    def filename(self) -> str:
        return f"{self.name}.py"

    def kernel(self, name: str) -> Kernel:
        return next(k for k in self.kernels if k.name == name)
