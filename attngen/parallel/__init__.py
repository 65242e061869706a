"""Stage after build: one sequence's attention sharded over many devices (context parallelism).

Each device holds a shard of the sequence's queries, keys and values; the generated kernels of the
spec's sharded form (attngen.spec.sharded: the mask and score see global positions through offset
params) run one block of queries against one block of keys, and the exact LSE merge joins the
blocks. Two transports, on the engines users already run:
    torch_distributed.py  torch.distributed process groups (NCCL on GPUs, gloo on CPUs)
    jax_shard_map.py      jax.shard_map over a mesh axis (XLA collectives)
Two modes in both: "ring" passes K/V blocks around the devices, overlapping each transfer with a
block's kernels (memory per device stays one shard); "allgather" gathers K/V once (simple, and
cheap where K/V are small: GQA, MQA).

This module holds what both share: where each device's shard lies in the sequence, and the
test that skips a whole block pair the mask hides (on the host for torch, traced for JAX).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from attngen import ir
from attngen.analysis.tiles import BY_QUERY_BLOCK, analyse_mask
from attngen.reference import evaluate
from attngen.spec import Spec, load_spec, sharded

LAYOUTS = ("contiguous", "zigzag")
MODES = ("ring", "allgather")


def chunk_sizes(length: int, chunks: int) -> list[int]:
    """`length` positions cut into `chunks` consecutive chunks, the first length % chunks one longer."""
    return [length // chunks + (i < length % chunks) for i in range(chunks)]


def held_chunks(world: int, rank, layout: str) -> list:
    """The chunks `rank` holds, in its local order (rank may be traced: plain arithmetic).

    contiguous: the r-th of `world` chunks. zigzag: of 2 * world chunks, r and 2 * world - 1 - r,
    so that under a causal mask every rank has as much work (the early chunk sees few keys, the
    late one many)."""
    return [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]


def pieces(length: int, world: int, rank: int, layout: str) -> list[tuple[int, int]]:
    """The (global start, size) of each piece of the sequence that `rank` holds (held_chunks), in
    its local order; chunk sizes differ by one position at most."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of {world}")
    sizes = chunk_sizes(length, world if layout == "contiguous" else 2 * world)
    starts = np.cumsum([0, *sizes]).tolist()
    return [(starts[c], sizes[c]) for c in held_chunks(world, rank, layout)]


def local_length(length: int, world: int, rank: int, layout: str) -> int:
    return sum(size for _, size in pieces(length, world, rank, layout))


def global_length(local_lengths: list[int], layout: str) -> int:
    """The sequence's length from every rank's local length, checked against the layout's rule."""
    world = len(local_lengths)
    length = sum(local_lengths)
    expected = [local_length(length, world, r, layout) for r in range(world)]
    if list(local_lengths) != expected:
        raise ValueError(
            f"shards of {list(local_lengths)} positions are not a {layout} layout of {length} (expected "
            f"{expected}); cut the sequence with attngen.parallel's shard()"
        )
    return length


@dataclass(frozen=True)
class ShardedSpec:
    """A spec and its sharded form, with the host-side bounds that skip hidden block pairs."""

    spec: Spec
    _modules: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, spec: Spec | str) -> ShardedSpec:
        return cls(spec if isinstance(spec, Spec) else load_spec(spec))

    @cached_property
    def form(self) -> Spec:
        return sharded(self.spec)

    def module(self, target: str):
        """The sharded form's generated module for `target` (attngen.load: built once, cached)."""
        if target not in self._modules:
            from attngen.build import load  # build imports the backends: only when a module is wanted

            self._modules[target] = load(self.form, target)
        return self._modules[target]

    @cached_property
    def _bounds(self):
        """Key ranges of one block of queries (one key per column block): None when they read more
        than sizes, offsets and scalar params (b, h, tensors), where every pair is visited."""
        params = {p.name: p.type for p in self.form.params if not p.is_tensor}
        bounds = analyse_mask(self.form.mask, params, 1, BY_QUERY_BLOCK)
        reads = frozenset().union(*(ir.variables(e) for e in (bounds.lo, bounds.hi)))
        loads = any(ir.loads(e) for e in (bounds.lo, bounds.hi))
        return None if loads or reads & {"b", "h"} else bounds

    def check_params(self, params: dict, totals: tuple[int, int]) -> None:
        """No unknown params; tensor params read at global positions hold the whole sequence."""
        unknown = sorted(params.keys() - {p.name for p in self.spec.params})
        if unknown:
            raise TypeError(f"spec {self.spec.name} has no params {unknown}")
        for p in self.form.params:
            shape = getattr(params.get(p.name), "shape", ())  # missing or mistyped: the module's checks say
            for axis, total in zip(("q_total", "kv_total"), totals):
                at = p.shape.index(axis) if axis in p.shape else None
                if at is not None and len(shape) == len(p.shape) and shape[at] != total:
                    raise ValueError(
                        f"param {p.name} is read at global positions: its axis {at} must hold the whole "
                        f"sequence ({total}), got {shape[at]}"
                    )

    def visits(self, q: tuple[int, int], kv: tuple[int, int], totals: tuple[int, int], params: dict, xp=np):
        """Whether queries q = (start, size) may see any key of kv = (start, size): False only when
        the tile analysis proves the pair EMPTY. xp=jax.numpy: starts and scalar params may be
        traced, and the answer is a traced bool (for lax.cond) unless the sizes or the mask decide."""
        if q[1] == 0 or kv[1] == 0:
            return False
        if self._bounds is None:
            return True
        env = {
            **{
                name: value
                for name, value in params.items()
                if isinstance(value, (int, float)) or (xp is not np and np.ndim(value) == 0)
            },
            "q_offset": q[0],
            "kv_offset": kv[0],
            "q_total": totals[0],
            "kv_total": totals[1],
            "q_first": 0,
            "q_last": q[1] - 1,
            "q_len": q[1],
            "kv_len": kv[1],
        }
        env["kv_lo"] = evaluate(self._bounds.lo, env, xp)  # hi may read lo
        visible = env["kv_lo"] < evaluate(self._bounds.hi, env, xp)
        return bool(visible) if xp is np else visible
