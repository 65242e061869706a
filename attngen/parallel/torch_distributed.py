"""Context-parallel attention over a torch.distributed process group (the generated Triton kernels).

    cp = ContextParallel("specs/causal.toml", group=None, mode="ring", layout="zigzag")
    q, k, v = (cp.shard(x) for x in (q, k, v))      # this rank's part of each sequence
    out = cp.attention(q, k, v)                     # this rank's queries' output; autograd works
    whole = cp.unshard(out)                         # every rank's parts, in sequence order

Tensors are [batch, heads, seq, head_dim], sharded along seq (use `layout` of the generated
`attention` for FlashAttention's order before sharding). Every rank calls with its shard of the same
problem; shards may differ in length by one chunk position (sequences not divisible by the world).

Ring mode: each of the world's steps runs this rank's queries against the K/V block it holds and
passes that block on to the next rank (batch_isend_irecv, in flight while the kernels run); the
LSE merge joins the steps in float32. Block pairs the mask hides (causal's upper triangle, a
sliding window's distant blocks) launch nothing. The backward runs the ring again: dQ stays home,
dK/dV accumulate in float32 as they travel with their block and arrive home after the last step.
All-gather mode gathers K/V once (autograd: the backward reduce-scatters dK/dV) and runs one call
per query piece.

NCCL refuses two ranks on one GPU; with gloo, GPU tensors travel through host memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from attngen.parallel import LAYOUTS, MODES, ShardedSpec, global_length, pieces
from attngen.reference import evaluate
from attngen.spec import Spec


class ContextParallel:
    """Attention of `spec` over a sequence sharded along the ranks of `group` (default: the world)."""

    def __init__(self, spec: Spec | str, group=None, mode: str = "ring", layout: str = "zigzag"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.sharded = ShardedSpec.of(spec)
        self.group, self.mode, self.layout = group, mode, layout
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.module = self.sharded.module("triton_gpu")

    # ------------------------------------------------------------------ sharding

    def shard(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """This rank's part of `x`, a whole sequence along `dim` (the same on every rank)."""
        parts = pieces(x.shape[dim], self.world, self.rank, self.layout)
        return torch.cat([x.narrow(dim, start, size) for start, size in parts], dim)

    def unshard(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """The whole sequence from every rank's part `x` along `dim` (all-gathered: every rank gets it)."""
        x = x.movedim(dim, 0)
        (lengths,) = self._lengths(x, x.shape[0])
        return _Gather.apply(self, x.contiguous(), lengths).movedim(0, dim)

    def _lengths(self, like: torch.Tensor, *local: int) -> list[list[int]]:
        """Every rank's local lengths (one small all-gather: shards may differ by a position)."""
        mine = torch.tensor(local, dtype=torch.int64, device=self._wire_device(like))
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        return [[int(n[i]) for n in every] for i in range(len(local))]

    # ------------------------------------------------------------------ attention

    def attention(self, q, k, v, *, scale=None, return_lse=False, **params):
        """Attention of this rank's queries against the whole sequence's keys.

        q [batch, heads, local_q, head_dim], k and v [batch, kv_heads, local_kv, head_dim]: this
        rank's shards (`shard`). params: the spec's, as the generated `attention` takes them (tensor
        params along q_len / kv_len are the whole sequence's). Returns this rank's output (and its
        natural-log LSE if return_lse); differentiable in q, k, v and in the params the spec trains
        ([grad] params, its sink's): their gradients are this rank's share (reduce them over the group).
        """
        if scale is None:
            scale = self.module.HEAD_DIM**-0.5
        q_lengths, kv_lengths = self._lengths(q, q.shape[2], k.shape[2])
        totals = (global_length(q_lengths, self.layout), global_length(kv_lengths, self.layout))
        self._check_params(params, totals)
        # The kernels never read the sink (the sharded form has none): it joins once, below.
        kernel_params = {p.name: params[p.name] for p in self.sharded.form.params if p.name in params}
        call = _Call(self, float(scale), kernel_params, totals)
        if self.mode == "ring":
            # The trained params enter the autograd function, which returns their gradients.
            out, lse = _Ring.apply(call, q, k, v, *(kernel_params.get(name) for name in call.trained))
        else:
            out, lse = call.allgather(q, k, v, kv_lengths)
        if self.sharded.spec.sink is not None:
            out, lse = _add_sink(out, lse, self._sink_logits(q, params))
        return (out, lse) if return_lse else out

    def _check_params(self, params: dict, totals: tuple[int, int]) -> None:
        self.sharded.check_params(params, totals)
        trained = self.sharded.form.grad_params
        for p in self.sharded.form.params:  # the kernels' (a param only the sink reads is not among them)
            value = params.get(p.name)
            if isinstance(value, torch.Tensor) and value.requires_grad and p.name not in trained:
                raise ValueError(
                    f"param {p.name} requires grad, and context-parallel attention gives it none"
                    f"{' (only ' + ', '.join(trained) + ' get one)' if trained else ''}: pass {p.name}.detach()"
                )

    def _sink_logits(self, q, params):
        batch, heads = q.shape[:2]
        index = {"b": torch.arange(batch, device=q.device)[:, None], "h": torch.arange(heads, device=q.device)[None, :]}
        logits = evaluate(self.sharded.spec.sink, {**params, **index}, xp=torch)
        return logits.float().expand(batch, heads)

    def _wire_device(self, like: torch.Tensor) -> torch.device:
        """Where tensors travel: host memory under gloo, else their own device."""
        return torch.device("cpu") if dist.get_backend(self.group) == "gloo" else like.device


def _add_sink(out, lse, sink):
    """Out and LSE with the sink joined to each row's denominator once (after every block's merge)."""
    sink = sink[..., None]
    total = torch.logaddexp(lse, sink)
    shift = torch.where(torch.isneginf(total), 0.0, total)
    return (out.float() * torch.exp(lse - shift)[..., None]).to(out.dtype), total


class _Call:
    """One call's problem: the module, scale, params, and where every rank's pieces lie."""

    def __init__(self, cp: ContextParallel, scale: float, params: dict, totals: tuple[int, int]):
        self.cp, self.scale, self.params, self.totals = cp, scale, params, totals
        # The params the sharded kernels' backward returns gradients for, in its order.
        self.trained = getattr(cp.module, "TRAINED_PARAMS", ())
        self.q_pieces = pieces(totals[0], cp.world, cp.rank, cp.layout)
        # The visible block pairs against each rank's K/V, found once (the bounds are evaluated on
        # the host) for the forward's trip round the ring and the backward's.
        self.pairs = [self._visible_pairs(rank) for rank in range(cp.world)]

    def kv_pieces(self, rank: int) -> list[tuple[int, int]]:
        return pieces(self.totals[1], self.cp.world, rank, self.cp.layout)

    def kernel_params(self, q_piece, kv_piece) -> dict:
        """The sharded kernels' params for one block pair."""
        sharding = {
            "q_offset": q_piece[0],
            "kv_offset": kv_piece[0],
            "q_total": self.totals[0],
            "kv_total": self.totals[1],
        }
        return {**self.params, **sharding}

    def _visible_pairs(self, kv_rank: int):
        """(local q slice, local kv slice, kernel params) of each visible block pair against kv_rank's block."""
        q_at, pairs = 0, []
        for qp in self.q_pieces:
            kv_at = 0
            for kp in self.kv_pieces(kv_rank):
                if self.cp.sharded.visits(qp, kp, self.totals, self.params):
                    pairs.append((slice(q_at, q_at + qp[1]), slice(kv_at, kv_at + kp[1]), self.kernel_params(qp, kp)))
                kv_at += kp[1]
            q_at += qp[1]
        return pairs

    def kv_shape(self, like: torch.Tensor, rank: int) -> tuple[int, ...]:
        length = sum(size for _, size in self.kv_pieces(rank % self.cp.world))
        return (*like.shape[:2], length, like.shape[3])

    # ------------------------------------------------------------------ ring

    def ring_forward(self, q, k, v):
        cp, module = self.cp, self.cp.module
        out = torch.zeros((*q.shape[:3], v.shape[3]), device=q.device, dtype=torch.float32)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
        held = (k, v)
        for step in range(cp.world):
            source = (cp.rank - step) % cp.world
            incoming = None
            if step < cp.world - 1:  # the next block, in flight while this one's kernels run
                incoming = _pass_on(cp, held, [self.kv_shape(k, source - 1), self.kv_shape(v, source - 1)])
            k_block, v_block = held
            for rows, cols, args in self.pairs[source]:
                part, part_lse = module.attention_forward(
                    q[:, :, rows], k_block[:, :, cols], v_block[:, :, cols], scale=self.scale, **args
                )
                out[:, :, rows], lse[:, :, rows] = module.merge_partials(
                    out[:, :, rows], lse[:, :, rows], part, part_lse
                )
            if incoming is not None:
                held = incoming.wait()
        return out.to(q.dtype), lse

    def ring_backward(self, dout, dlse, q, k, v, out, lse):
        """(dq, dk, dv, and this rank's share of each trained param's gradient)."""
        cp, module = self.cp, self.cp.module
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        dparams = [torch.zeros(self.params[name].shape, device=q.device, dtype=torch.float32) for name in self.trained]
        held, arriving = (k, v), None
        for step in range(cp.world):
            source = (cp.rank - step) % cp.world
            incoming = None
            if step < cp.world - 1:
                incoming = _pass_on(cp, held, [self.kv_shape(k, source - 1), self.kv_shape(v, source - 1)])
            k_block, v_block = held
            dk = torch.zeros(k_block.shape, device=q.device, dtype=torch.float32)
            dv = torch.zeros(v_block.shape, device=q.device, dtype=torch.float32)
            for rows, cols, args in self.pairs[source]:
                dq_part, dk_part, dv_part, *dparam_parts = module.attention_backward(
                    dout[:, :, rows],
                    dlse[:, :, rows],
                    q[:, :, rows],
                    k_block[:, :, cols],
                    v_block[:, :, cols],
                    out[:, :, rows],
                    lse[:, :, rows],
                    scale=self.scale,
                    **args,
                )
                dq[:, :, rows] += dq_part
                dk[:, :, cols] += dk_part
                dv[:, :, cols] += dv_part
                for total, part in zip(dparams, dparam_parts):
                    total += part
            if arriving is not None:  # what the ranks before this one added to this block
                dk_before, dv_before = arriving.wait()
                dk += dk_before
                dv += dv_before
            # Pass the block's sums on; the last step's arrive home (this rank's own block).
            arriving = _pass_on(cp, (dk, dv), [self.kv_shape(dk, source - 1), self.kv_shape(dv, source - 1)])
            if incoming is not None:
                held = incoming.wait()
        dk, dv = arriving.wait()
        dparams = [d.to(self.params[name].dtype) for name, d in zip(self.trained, dparams)]
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *dparams

    # ------------------------------------------------------------------ all-gather

    def allgather(self, q, k, v, kv_lengths):
        """K/V gathered once into sequence order; one differentiable call per query piece."""
        k_all = _Gather.apply(self.cp, k.movedim(2, 0).contiguous(), kv_lengths).movedim(0, 2)
        v_all = _Gather.apply(self.cp, v.movedim(2, 0).contiguous(), kv_lengths).movedim(0, 2)
        outs, lses, at = [], [], 0
        for start, size in self.q_pieces:
            part = q[:, :, at : at + size]
            args = self.kernel_params((start, size), (0, self.totals[1]))
            o, l = self.cp.module.attention(part, k_all, v_all, scale=self.scale, return_lse=True, **args)
            outs.append(o)
            lses.append(l)
            at += size
        return torch.cat(outs, 2), torch.cat(lses, 2)


class _Ring(torch.autograd.Function):
    """Ring attention (see the module doc): forward and backward each one trip around the ranks."""

    @staticmethod
    def forward(ctx, call, q, k, v, *trained):  # trained: call's trained params (the kernels read them there)
        out, lse = call.ring_forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return None, *ctx.call.ring_backward(dout.contiguous(), dlse.contiguous(), *ctx.saved_tensors)


def _pass_on(cp: ContextParallel, send: tuple, shapes: list) -> _InFlight:
    """Send `send` to the next rank and receive tensors of `shapes` from the previous one (started,
    not waited for)."""
    if cp.world == 1:  # the next rank is this one
        return _InFlight([], list(send), send[0].device, [])
    wire = cp._wire_device(send[0])
    received = [torch.empty(shape, device=wire, dtype=t.dtype) for shape, t in zip(shapes, send)]
    staged = [t.to(wire).contiguous() for t in send]
    nxt, prev = (cp.rank + 1) % cp.world, (cp.rank - 1) % cp.world
    if cp.group is not None:
        nxt, prev = dist.get_global_rank(cp.group, nxt), dist.get_global_rank(cp.group, prev)
    ops = [dist.P2POp(dist.isend, t, nxt, cp.group) for t in staged]
    ops += [dist.P2POp(dist.irecv, t, prev, cp.group) for t in received]
    return _InFlight(dist.batch_isend_irecv(ops), received, send[0].device, staged)


class _InFlight:
    """Transfers under way: `wait` returns the received tensors on the sender's device."""

    def __init__(self, requests, received, device, staged):
        self.requests, self.received, self.device, self.staged = requests, received, device, staged

    def wait(self) -> list[torch.Tensor]:
        for request in self.requests:
            request.wait()
        return [t.to(self.device) for t in self.received]


class _Gather(torch.autograd.Function):
    """Every rank's pieces of a sequence (axis 0), all-gathered into sequence order; the backward
    sums each rank's gradients of this rank's pieces (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, cp, x, lengths):
        wire = cp._wire_device(x)
        longest = max(lengths)
        padded = torch.zeros((longest, *x.shape[1:]), device=wire, dtype=x.dtype)
        padded[: x.shape[0]] = x.to(wire)
        every = [torch.empty_like(padded) for _ in lengths]
        dist.all_gather(every, padded, group=cp.group)
        total = sum(lengths)
        whole = torch.empty((total, *x.shape[1:]), device=wire, dtype=x.dtype)
        for rank, part in enumerate(every):
            at = 0
            for start, size in pieces(total, cp.world, rank, cp.layout):
                whole[start : start + size] = part[at : at + size]
                at += size
        ctx.cp, ctx.lengths, ctx.device = cp, lengths, x.device
        return whole.to(x.device)

    @staticmethod
    def backward(ctx, grad):
        cp, lengths = ctx.cp, ctx.lengths
        wire = cp._wire_device(grad)
        grad = grad.to(wire)
        total, longest = grad.shape[0], max(lengths)
        parts = torch.zeros((cp.world, longest, *grad.shape[1:]), device=wire, dtype=torch.float32)
        for rank in range(cp.world):
            at = 0
            for start, size in pieces(total, cp.world, rank, cp.layout):
                parts[rank, at : at + size] = grad[start : start + size]
                at += size
        if dist.get_backend(cp.group) == "nccl":
            mine = torch.empty_like(parts[0])
            dist.reduce_scatter_tensor(mine, parts, group=cp.group)
        else:  # gloo has no reduce-scatter
            dist.all_reduce(parts, group=cp.group)
            mine = parts[cp.rank]
        return None, mine[: lengths[cp.rank]].to(ctx.device, grad.dtype), None
