"""attngen's kernels inside torch's own context parallelism (torch.distributed.tensor.experimental).

torch's ring attention (`_templated_ring_attention` and `_templated_ring_attention_backward` in
torch/distributed/tensor/experimental/_context_parallel/_attention.py, torch 2.13) takes the
attention op as an argument: the forward calls op(q, k, v, is_causal=..., **kwargs) -> (out, lse,
*rest) for each K/V block and merges the blocks by their LSEs (natural log, float32: attngen's
convention); the backward calls op(query=, key=, value=, out=, logsumexp=, is_causal=, grad_out=,
**kwargs) -> (dq, dk, dv, *rest). TorchRing supplies both ops from generated modules and wraps the
two templates in one autograd Function:

    ring = TorchRing(causal="specs/causal.toml", full="specs/full.toml")
    q, k, v = _context_parallel_shard(mesh, [q, k, v], [2, 2, 2], load_balancer=_HeadTailLoadBalancer(L, world, "cuda"))
    out = ring.attention(q, k, v, mesh=mesh, is_causal=True)        # differentiable in q, k, v
    (out,) = context_parallel_unshard(mesh, [out], [2], load_balancer=...)

(or shard inside torch's `context_parallel(mesh, buffers=..., buffer_seq_dims=...)` context, which
picks the head-tail balancer itself when the length divides by 2 * world).

What torch's ring gives the op, and so what this route can run:
* Per block only a flag, is_causal in {True, False} (blocks it skips are never called): True on the
  diagonal block (a rank's own Q against its own K/V, equal lengths: top-left causal over the local
  concatenation, right under the head-tail layout too), False on every other visited block (all
  keys visible; with load balancing torch halves Q or K/V itself). No global positions reach the
  op, so only causal and full (bidirectional) attention fit: `causal` must be a top-left causal
  spec, `full` the same score without a mask. Masks or scores that read positions (sliding window,
  documents, ALiBi) need attngen.parallel.torch_distributed.ContextParallel, whose "zigzag" layout
  is exactly torch's _HeadTailLoadBalancer order (the same shards work with both).
* torch refuses is_causal=False while `_cp_options.enable_load_balance` is set: shard full
  attention without a load balancer (`_context_parallel_shard(..., load_balancer=None)` clears it).
* The backward op receives no LSE cotangent: the LSE returned here is not differentiable.
* The specs take no params (torch's ring passes none per block) and have no sink (it would join
  once per block).

The entry points are torch's private, experimental API; this module is tested against torch 2.13
(tests/test_torch_context_parallel.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from attngen.spec import Spec, load_spec


class TorchRing:
    """Generated kernels as the attention op of torch's ring templates.

    causal: the spec run on the diagonal block (is_causal=True), top-left causal; full: the spec run
    on fully visible blocks (is_causal=False). Specs or paths of spec files, built with
    attngen.load; one of them may be None when torch is never asked for it (full attention needs
    no causal kernel). Both must share head_dim, head_dim_v and dtype and take no params.
    """

    def __init__(self, causal: Spec | str | Path | None = None, full: Spec | str | Path | None = None):
        from attngen.build import load

        if causal is None and full is None:
            raise ValueError("TorchRing needs a causal spec, a full spec, or both")
        self.modules = {}
        for is_causal, spec in ((True, causal), (False, full)):
            if spec is None:
                continue
            spec = spec if isinstance(spec, Spec) else load_spec(spec)
            _check_mask(spec, is_causal)
            self.modules[is_causal] = load(spec, "triton_gpu")
        shapes = {(m.HEAD_DIM, m.HEAD_DIM_V, m.DTYPE) for m in self.modules.values()}
        if len(shapes) > 1:
            raise ValueError(f"the causal and full specs differ in (head_dim, head_dim_v, dtype): {shapes}")

    def _module(self, is_causal: bool):
        if is_causal not in self.modules:
            kind = "causal" if is_causal else "full"
            raise ValueError(f"torch's ring asked for a {kind} block, and TorchRing has no {kind} spec")
        return self.modules[is_causal]

    # ------------------------------------------------------------------ the ops torch's templates call

    def forward_op(self, query, key, value, *, is_causal: bool, scale=None):
        """One block: (out, lse), lse natural-log float32 [B, H, Lq] (what the merge expects)."""
        return self._module(is_causal).attention_forward(query, key, value, scale=scale)

    def backward_op(self, *, grad_out, query, key, value, out, logsumexp, is_causal: bool, scale=None):
        """One block's (dq, dk, dv), given the merged out and lse of its rows (no LSE cotangent)."""
        dlse = torch.zeros_like(logsumexp, dtype=torch.float32)
        return self._module(is_causal).attention_backward(
            grad_out, dlse, query, key, value, out, logsumexp, scale=scale
        )

    # ------------------------------------------------------------------ attention

    def attention(self, q, k, v, *, mesh=None, group=None, is_causal: bool, scale=None, return_lse=False):
        """This rank's output of ring attention over a 1-D mesh (or a process group).

        q [B, H, local_len, D], k and v [B, H_kv, local_len, D]: this rank's shards as torch's
        _context_parallel_shard / context_parallel cut them (head-tail with a load balancer,
        contiguous without). Differentiable in q, k, v; the LSE (if return_lse) is not.
        """
        if (mesh is None) == (group is None):
            raise ValueError("pass one of mesh (a 1-D DeviceMesh) and group (a ProcessGroup)")
        group = mesh.get_group() if mesh is not None else group
        out, lse = _TorchRingFunction.apply(self, group, bool(is_causal), scale, q, k, v)
        return (out, lse) if return_lse else out


class _TorchRingFunction(torch.autograd.Function):
    """torch's forward and backward ring templates, with TorchRing's ops."""

    @staticmethod
    def forward(ctx, ring, group, is_causal, scale, q, k, v):
        from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

        out, lse, *_ = _templated_ring_attention(group, 2, ring.forward_op, q, k, v, is_causal=is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.group, ctx.is_causal, ctx.scale = ring, group, is_causal, scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        from torch.distributed.tensor.experimental._context_parallel._attention import (
            _templated_ring_attention_backward,
        )

        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv, *_ = _templated_ring_attention_backward(
            ctx.group, 2, ctx.ring.backward_op, dout.contiguous(), "grad_out", q, k, v, out, lse,
            ctx.is_causal, scale=ctx.scale,
        )  # fmt: skip
        return None, None, None, None, dq, dk, dv


def _check_mask(spec: Spec, is_causal: bool) -> None:
    """The spec's mask is what torch assumes of the block (top-left causal, or every key), checked
    on a few small blocks; its score may not read positions, and it has no params and no sink."""
    import numpy as np

    from attngen import ir
    from attngen.reference import dense_mask

    if spec.params:
        raise ValueError(f"spec {spec.name} takes params {[p.name for p in spec.params]}; torch's ring passes none")
    if spec.sink is not None:
        raise ValueError(f"spec {spec.name} has a sink: torch's ring would add it once per block, not once per row")
    if spec.score is not None and ir.variables(spec.score) & {"q_idx", "kv_idx", "q_len", "kv_len"}:
        raise ValueError(f"spec {spec.name}'s score reads positions, which torch's ring does not pass")
    for n in (1, 7, 33):
        got = np.asarray(dense_mask(spec, 1, 1, n, n, {})[0, 0], dtype=bool)
        want = np.tril(np.ones((n, n), dtype=bool)) if is_causal else np.ones((n, n), dtype=bool)
        if not (got == want).all():
            kind, blocks = ("top-left causal", "causal") if is_causal else ("unmasked (every key visible)", "full")
            raise ValueError(f"spec {spec.name} is not {kind}, as torch's ring assumes of its {blocks} blocks")
