"""The validated spec: what every later stage reads (frozen dataclasses holding typed IR)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from attngen import ir
from attngen.backends import TARGETS
from attngen.backends.base import ProblemShape
from attngen.lang import parser
from attngen.lang.typecheck import Scope, typecheck

DTYPES = ("float16", "bfloat16", "float32")
PARAM_TYPES = {"int": ir.Type.INT, "float": ir.Type.FLOAT}
# A tensor's elements may also be bools (a mask table: true = attend), read as they are.
TENSOR_TYPES = {**PARAM_TYPES, "bool": ir.Type.BOOL}
# Axis names of a tensor param that stand for the attention problem's own sizes; any other name
# is a size of the caller's choosing (the same name is the same size in every tensor).
SIZE_NAMES = ("batch", "heads", "kv_heads", "q_len", "kv_len")
MAX_TENSOR_RANK = 4
CAUSAL_MASK = "q_idx >= kv_idx"
# `causal` in [mask]: how the diagonal sits when q_len != kv_len. Top-left: query i sees keys
# 0..i. Bottom-right (FlashAttention >= 2.1): the last query sees every key, as when the queries
# are the last q_len of kv_len positions (decoding with a cache, chunked prefill).
CAUSAL_MASKS = {True: CAUSAL_MASK, "top_left": CAUSAL_MASK, "bottom_right": "q_idx + kv_len - q_len >= kv_idx"}

# Names a param may not take: the language's own, the generated functions' arguments, and the
# names the kernels use internally.
RESERVED_NAMES = frozenset(
    {*ir.INDEX_VARS, *ir.SIZE_VARS, "score", "where", "inf", *ir.FUNCTIONS}
    | {"q", "k", "v", "scale", "return_lse", "interpret"}
)
MAX_SPEC_BYTES = 1 << 20  # a spec is a few hundred bytes; this bounds what a stray path can cost


@dataclass(frozen=True)
class Param:
    """A runtime argument declared in [params]: a scalar, or a tensor of `shape` (axis sizes: an
    int, a name of SIZE_NAMES, or a free size name) that expressions index."""

    name: str
    type: ir.Type
    shape: tuple[int | str, ...] = ()  # () for a scalar

    @property
    def is_tensor(self) -> bool:
        return bool(self.shape)

    @property
    def declared(self) -> str:
        """The type as written in [params], e.g. "float[heads, buckets]"."""
        dims = ", ".join(map(str, self.shape))
        return f"{self.type.value}[{dims}]" if self.shape else self.type.value


@dataclass(frozen=True)
class Spec:
    name: str
    head_dim: int
    dtype: str
    mask: ir.Expr | None  # None: every key visible
    score: ir.Expr | None  # None: the score is the scaled logit itself
    params: tuple[Param, ...]
    # Per target (by its name): the keys the spec set in the target's table, and the config its
    # backend made of them (unset keys defaulted). attngen.backends owns both.
    tables: dict[str, dict[str, int]]
    configs: dict[str, Any]
    path: str
    sha256: str
    mask_source: str | None = None
    head_dim_v: int | None = None  # v's (and the output's) head dim, when it differs from q's and k's
    # An attention sink (gpt-oss): one logit per (batch, head) that joins every row's softmax
    # denominator and carries no value. None: no sink.
    sink: ir.Expr | None = None
    # The packed form of a spec (attngen.spec.varlen): the generated modules add attention_varlen.
    varlen: bool = False
    # Float tensor params the backward returns gradients for ([grad] params): trained biases, slopes.
    grad_params: tuple[str, ...] = ()

    @property
    def value_dim(self) -> int:
        """The head dim of v and of the output."""
        return self.head_dim_v or self.head_dim

    def config(self, target: str) -> Any:
        """The config of target `target` (e.g. "triton_gpu")."""
        return self.configs[target]


def trained_position_reads(score: ir.Expr | None, grad_params: tuple[str, ...]) -> tuple[list, list]:
    """The score's reads of trained tensors that read the positions: those at the pair's own
    position (each index a variable: their gradient is written per pair), and those through an index
    computed from the positions (q_idx - kv_idx: a relative table, summed along diagonals)."""
    loads = ir.loads(score) if score is not None else ()
    reads = [load for load in loads if load.tensor in grad_params and ir.reads_positions(load)]
    own = [load for load in reads if all(isinstance(i, ir.Var) for i in load.indices)]
    return own, [load for load in reads if load not in own]


@cache
def _causal_ir() -> ir.Expr:
    """CAUSAL_MASK as the type checker gives it (ProblemShape.causal)."""
    expr, problems = typecheck(parser.parse(CAUSAL_MASK), Scope({}, allow_score=False), ir.Type.BOOL)
    assert expr is not None and not problems, problems
    return expr


def problem_shape(
    head_dim: int,
    head_dim_v: int,
    dtype: str,
    mask: ir.Expr | None,
    score: ir.Expr | None,
    grad_params: tuple[str, ...],
) -> ProblemShape:
    """What the targets' configs depend on (ProblemShape): the head dims and dtype, whether the score
    has trained reads of each kind of trained_position_reads, whether it reads a tensor at each pair,
    whether there is a mask or a score, and whether the mask is CAUSAL_MASK alone."""
    own, computed = trained_position_reads(score, grad_params)
    pairs = score is not None and ir.reads_pairs(score)
    plain = mask is None and score is None
    causal = score is None and mask == _causal_ir()
    return ProblemShape(head_dim, head_dim_v, dtype, bool(own), bool(computed), pairs, plain, causal)


def retarget(spec: Spec, head_dim: int, dtype: str) -> Spec:
    """The spec at another head_dim and dtype, each target's unset keys re-defaulted (for tools
    that sweep shapes, such as the benchmarks)."""
    shape = problem_shape(head_dim, spec.head_dim_v or head_dim, dtype, spec.mask, spec.score, spec.grad_params)
    configs = {t.name: t.make_config(spec.tables[t.name], shape, _refuse) for t in TARGETS}
    return replace(spec, head_dim=head_dim, dtype=dtype, configs=configs)


def with_config(spec: Spec, target: str, **fields: Any) -> Spec:
    """The spec with fields of one target's config replaced as given (no defaults, no pinning
    rules): tools and tests that try other tiles. Generated code names its config, so the build
    and every cache keyed by the rendered source see the change."""
    return replace(spec, configs={**spec.configs, target: dataclasses.replace(spec.configs[target], **fields)})


def _refuse(message: str, key: str | None = None, hint: str | None = None) -> None:
    raise ValueError(message)
