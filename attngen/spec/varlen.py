"""A spec's packed form: FlashAttention's variable-length interface (`flash_attn_varlen_func`).

The sequences of a batch lie end to end in q [total_q, heads, head_dim] and k, v [total_k, ...],
cut by `cu_seqlens_q` / `cu_seqlens_k`. The packed spec applies the spec within each sequence: its
mask and score see each token's position in its own sequence, that sequence's lengths and its
index as `b`, and no query sees another sequence's keys. It is the spec with six int tensors that
the generated `attention_varlen` builds from the cu_seqlens (one entry per packed token; a
packed spec declares those its expressions read):

    seq_q[b, q_idx], seq_kv[b, kv_idx]  the token's sequence
    pos_q[b, q_idx], pos_kv[b, kv_idx]  its position in that sequence
    len_q[b, q_idx], len_kv[b, kv_idx]  that sequence's length

mask' = seq_q[b, q_idx] == seq_kv[b, kv_idx] and mask(q_idx -> pos_q[b, q_idx], kv_idx ->
pos_kv[b, kv_idx], q_len -> len_q[b, q_idx], kv_len -> len_kv[b, kv_idx], b -> seq_q[b, q_idx]),
and the score likewise. Reading tensors at each position, the packed mask has no closed-form tile
bounds: the kernels walk run-time block tables, which skip the tiles between sequences.
"""

from __future__ import annotations

from dataclasses import replace

from attngen import ir
from attngen.errors import Diagnostic, SpecError
from attngen.spec.model import Param, Spec

PACKING = {  # name -> the packed axis its entries follow
    "seq_q": "q_len",
    "seq_kv": "kv_len",
    "pos_q": "q_len",
    "pos_kv": "kv_len",
    "len_q": "q_len",
    "len_kv": "kv_len",
}


def packed(spec: Spec) -> Spec:
    """The spec applied within each of the sequences packed end to end (see the module doc)."""

    def refuse(message: str) -> SpecError:
        return SpecError([Diagnostic(f"{spec.name} has no packed (varlen) form: {message}", None)])

    clash = sorted(PACKING.keys() & {p.name for p in spec.params})
    if clash:
        raise refuse(f"its params {', '.join(clash)} take the names of the packing tensors")
    per_position = [p.name for p in spec.params if {"q_len", "kv_len"} & set(p.shape)]
    if per_position:
        raise refuse(f"tensor params along q_len or kv_len ({', '.join(per_position)}) have no per-sequence layout yet")
    if spec.sink is not None and "b" in ir.variables(spec.sink):
        raise refuse("its sink reads b, and a packed row's sequence varies along the row")

    b, q_idx, kv_idx = (ir.Var(ir.Type.INT, name, ir.VarKind.INDEX) for name in ("b", "q_idx", "kv_idx"))
    at_query = {name: ir.Load(ir.Type.INT, name, (b, q_idx)) for name in ("seq_q", "pos_q", "len_q")}
    at_key = {name: ir.Load(ir.Type.INT, name, (b, kv_idx)) for name in ("seq_kv", "pos_kv", "len_kv")}
    within = {
        q_idx: at_query["pos_q"],
        kv_idx: at_key["pos_kv"],
        ir.Var(ir.Type.INT, "q_len", ir.VarKind.SIZE): at_query["len_q"],
        ir.Var(ir.Type.INT, "kv_len", ir.VarKind.SIZE): at_key["len_kv"],
        b: at_query["seq_q"],  # b is the sequence
    }
    same_sequence = ir.Compare(ir.Type.BOOL, "==", at_query["seq_q"], at_key["seq_kv"])
    mask = (
        same_sequence
        if spec.mask is None
        else ir.Logic(ir.Type.BOOL, "and", same_sequence, ir.substitute(spec.mask, within))
    )
    score = ir.substitute(spec.score, within) if spec.score is not None else None
    # A param along the batch now has one entry per sequence: a size of the caller's choosing.
    params = tuple(replace(p, shape=tuple("sequences" if a == "batch" else a for a in p.shape)) for p in spec.params)
    reads = frozenset().union(*(ir.variables(e) for e in (mask, score, spec.sink) if e is not None))
    packing = tuple(Param(name, ir.Type.INT, ("batch", axis)) for name, axis in PACKING.items() if name in reads)
    return replace(
        spec, name=f"{spec.name}_varlen", mask=mask, score=score, params=params + packing, mask_source=None, varlen=True
    )
