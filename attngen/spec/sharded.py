"""A spec's sharded form: one shard of a long sequence's queries against one shard of its keys.

Context parallelism (attngen.parallel) splits a sequence over devices; each kernel call then sees a
block of the queries against a block of the keys, and the mask and score must see the sequence's
true positions, not the block's. The sharded spec is the spec with four int params the caller
passes per call:

    q_offset, kv_offset  the global position of the block's first query / key
    q_total, kv_total    the whole sequence's lengths (what the spec's q_len / kv_len mean)

mask' = q_idx + q_offset < q_total and kv_idx + kv_offset < kv_total and mask(q_idx -> q_idx +
q_offset, kv_idx -> kv_idx + kv_offset, q_len -> q_total, kv_len -> kv_total), and the score
likewise. The first two conjuncts hide positions past the sequence: a device's block may be
padded (JAX shards arrays in equal parts). Tensor params along q_len / kv_len are the whole
sequence's (axes q_total / kv_total), read at global positions.

The offsets are plain int params, so the tile analysis bounds the sharded mask in closed form where
it bounds the spec's: a causal block pair below the diagonal is FULL, above it EMPTY, and whole
block pairs the mask hides are skipped without a launch (attngen.parallel asks `visits`). The sink,
added once per row, is left to the caller's merge (a shard must not add it once per block), and
a param only the sink reads leaves with it. [grad] params read at indices that read no position
(`slopes[h]`) or through q_idx - kv_idx (a relative table) stay trained: each block's backward
returns its share, and attngen.parallel sums the shares. A [grad] param read at each pair's own
position (`bias[b, h, q_idx, kv_idx]`) has no sharded form: its gradient, a whole [q_len, kv_len]
array, would be built on every device.
"""

from __future__ import annotations

from dataclasses import replace

from attngen import ir
from attngen.errors import Diagnostic, SpecError
from attngen.spec.model import Param, Spec, trained_position_reads

SHARDING = ("q_offset", "kv_offset", "q_total", "kv_total")
_GLOBAL_AXES = {"q_len": "q_total", "kv_len": "kv_total"}


def sharded(spec: Spec) -> Spec:
    """The spec on one block of queries against one block of keys of a longer sequence (see the
    module doc)."""
    clash = sorted(set(SHARDING) & {p.name for p in spec.params})
    if clash:
        raise SpecError(
            [
                Diagnostic(
                    f"{spec.name} has no sharded form: its params {', '.join(clash)} take the names of the sharding params",
                    None,
                )
            ]
        )
    if spec.varlen:
        raise SpecError([Diagnostic(f"{spec.name} is packed (varlen); shard the spec itself", None)])
    own, _ = trained_position_reads(spec.score, spec.grad_params)  # (a relative table stays trained)
    positional = sorted({load.tensor for load in own})
    if positional:
        raise SpecError(
            [
                Diagnostic(
                    f"{spec.name} has no sharded form: it trains {', '.join(positional)}, read at each (query, key) "
                    "pair, whose gradient would be a whole [q_len, kv_len] array on every device; shard a copy of "
                    f"the spec without {', '.join(positional)} in [grad] params, or train it without context parallelism",
                    None,
                )
            ]
        )

    int_var = lambda name, kind=ir.VarKind.PARAM: ir.Var(ir.Type.INT, name, kind)
    q_idx, kv_idx = int_var("q_idx", ir.VarKind.INDEX), int_var("kv_idx", ir.VarKind.INDEX)
    q_offset, kv_offset, q_total, kv_total = (int_var(name) for name in SHARDING)
    q_pos = ir.Arith(ir.Type.INT, "+", q_idx, q_offset)
    kv_pos = ir.Arith(ir.Type.INT, "+", kv_idx, kv_offset)
    globally = {
        q_idx: q_pos,
        kv_idx: kv_pos,
        int_var("q_len", ir.VarKind.SIZE): q_total,
        int_var("kv_len", ir.VarKind.SIZE): kv_total,
    }
    within = ir.Logic(
        ir.Type.BOOL,
        "and",
        ir.Compare(ir.Type.BOOL, "<", q_pos, q_total),
        ir.Compare(ir.Type.BOOL, "<", kv_pos, kv_total),
    )
    mask = within if spec.mask is None else ir.Logic(ir.Type.BOOL, "and", within, ir.substitute(spec.mask, globally))
    score = ir.substitute(spec.score, globally) if spec.score is not None else None
    reads = frozenset().union(*(ir.variables(e) for e in (mask, score) if e is not None))
    params = tuple(
        replace(p, shape=tuple(_GLOBAL_AXES.get(a, a) for a in p.shape))
        for p in spec.params
        if p.name in reads or spec.sink is None or p.name not in ir.variables(spec.sink)  # a sink-only param goes
    )
    sharding = tuple(Param(name, ir.Type.INT) for name in SHARDING)
    return replace(
        spec,
        name=f"{spec.name}_sharded",
        mask=mask,
        score=score,
        params=params + sharding,
        mask_source=None,
        sink=None,
        grad_params=tuple(name for name in spec.grad_params if name in {p.name for p in params}),
    )
