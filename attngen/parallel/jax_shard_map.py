"""Context-parallel attention with jax.shard_map (the generated Pallas kernels).

    cp = ContextParallel("specs/causal.toml", mesh, "seq", mode="ring", layout="zigzag")
    out = cp.attention(q, k, v)          # global arrays in, global out; jax.jit and jax.grad work

q, k, v are whole [batch, heads, seq, head_dim] arrays (sharded or not); the sequence is cut over
the mesh axis `axis` inside: padded to a multiple of the chunks (the sharded spec hides positions
past the sequence), put in the layout's order (zigzag: device r holds chunks r and 2W - 1 - r),
and the output put back. Offsets are traced (lax.axis_index), so the kernels take them as traced
params; a block pair the mask hides whole (causal's upper triangle, a window's distant blocks) runs
no kernel (lax.cond on the closed-form bounds, traced), and tile bounds skip EMPTY tiles inside.

Ring mode is a jax.custom_vjp: the forward passes K/V around the ring with lax.ppermute (XLA
overlaps each permute with the block's kernels), the backward runs the ring again with the merged
out and LSE, dK/dV travelling with their block and home after the last step, and the params the
spec trains ([grad] params) summing each block's share; the residuals are this device's q, k, v,
out and LSE only. All-gather mode gathers K/V with lax.all_gather and
lets autodiff transpose it (a reduce-scatter of dK/dV).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attngen.parallel import LAYOUTS, MODES, ShardedSpec, held_chunks
from attngen.reference import evaluate
from attngen.spec import Spec


class ContextParallel:
    """Attention of `spec` over a sequence sharded along mesh axis `axis`."""

    def __init__(
        self, spec: Spec | str, mesh, axis: str, mode: str = "ring", layout: str = "zigzag", interpret: bool = False
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.sharded = ShardedSpec.of(spec)
        if dict(zip(mesh.axis_names, mesh.axis_types))[axis] != jax.sharding.AxisType.Auto:
            raise ValueError(
                f"mesh axis {axis!r} is {dict(zip(mesh.axis_names, mesh.axis_types))[axis]}: context parallelism reorders the "
                "sequence itself and needs an Auto axis (jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,)))"
            )
        self.mesh, self.axis, self.mode, self.layout, self.interpret = mesh, axis, mode, layout, interpret
        self.world = mesh.shape[axis]
        self.module = self.sharded.module("pallas_tpu")

    @property
    def chunks(self) -> int:
        return self.world if self.layout == "contiguous" else 2 * self.world

    def _order(self) -> list[int]:
        """The chunks in device order: device r holds the r-th run of them."""
        return [c for r in range(self.world) for c in held_chunks(self.world, r, self.layout)]

    def _to_devices(self, x, chunk: int):
        """x [B, H, N, D] padded to chunks * chunk positions, its chunks in device order."""
        x = jnp.pad(x, ((0, 0), (0, 0), (0, self.chunks * chunk - x.shape[2]), (0, 0)))
        x = x.reshape(*x.shape[:2], self.chunks, chunk, *x.shape[3:])[:, :, self._order()]
        return x.reshape(*x.shape[:2], self.chunks * chunk, *x.shape[4:])

    def _from_devices(self, x, chunk: int, length: int):
        inverse = sorted(range(self.chunks), key=self._order().__getitem__)
        x = x.reshape(*x.shape[:2], self.chunks, chunk, *x.shape[3:])[:, :, inverse]
        return x.reshape(*x.shape[:2], self.chunks * chunk, *x.shape[4:])[:, :, :length]

    def attention(self, q, k, v, *, scale=None, return_lse=False, **params):
        """Attention of the whole sequence, computed sharded: out [B, H, N, Dv] (and the natural-log
        LSE [B, H, N] if return_lse). params: the spec's (scalars may be traced; tensor params along
        q_len / kv_len hold the whole sequence). Differentiable in q, k, v and the params the spec
        trains ([grad] params, its sink's); the others get no gradient."""
        q_len, kv_len = q.shape[2], k.shape[2]
        q_chunk, kv_chunk = -(-q_len // self.chunks), -(-kv_len // self.chunks)
        totals = (q_len, kv_len)
        self.sharded.check_params(params, totals)
        # The kernels never read the sink (the sharded form has none): it joins once, below. Arrays
        # (tensor params, traced scalars) enter the shard_map replicated; Python numbers are constants.
        kernel_params = {p.name: params[p.name] for p in self.sharded.form.params if p.name in params}
        arrays = {name: value for name, value in kernel_params.items() if isinstance(value, jax.Array)}
        constants = {name: value for name, value in kernel_params.items() if name not in arrays}
        run = partial(
            self._ring if self.mode == "ring" else self._allgather,
            scale=scale,
            totals=totals,
            chunks=(q_chunk, kv_chunk),
            constants=constants,
        )
        seq = P(None, None, self.axis)
        sharded_run = jax.shard_map(
            run, mesh=self.mesh, in_specs=(seq, seq, seq, P()), out_specs=(seq, seq), check_vma=False
        )
        placed = partial(lax.with_sharding_constraint, shardings=NamedSharding(self.mesh, seq))
        out, lse = sharded_run(
            placed(self._to_devices(q, q_chunk)),
            placed(self._to_devices(k, kv_chunk)),
            placed(self._to_devices(v, kv_chunk)),
            arrays,
        )
        out = self._from_devices(out, q_chunk, q_len)
        lse = self._from_devices(lse[..., None], q_chunk, q_len)[..., 0]
        if self.sharded.spec.sink is not None:
            out, lse = _add_sink(out, lse, self._sink_logits(q, params))
        return (out, lse) if return_lse else out

    def _sink_logits(self, q, params):
        """The spec's sink for every (batch, head), [B, H] float32, differentiable in its params."""
        batch, heads = q.shape[:2]
        index = {"b": jnp.arange(batch)[:, None], "h": jnp.arange(heads)[None, :]}
        logits = evaluate(self.sharded.spec.sink, {**params, **index}, xp=jnp)
        return jnp.broadcast_to(logits.astype(jnp.float32), (batch, heads))

    def _pieces(self, device, chunk: int):
        """(global start, local start) of each chunk a device holds; starts traced from its index."""
        return [(c * chunk, i * chunk) for i, c in enumerate(held_chunks(self.world, device, self.layout))]

    def _kernel_params(self, params, q_start, kv_start, totals):
        sharding = {"q_offset": q_start, "kv_offset": kv_start, "q_total": totals[0], "kv_total": totals[1]}
        return {**params, **{name: jnp.asarray(value, jnp.int32) for name, value in sharding.items()}}

    # ------------------------------------------------------------------ all-gather

    def _allgather(self, q, k, v, arrays, *, scale, totals, chunks, constants):
        """On one device: K/V gathered (sequence order), one differentiable call per query chunk."""
        params = {**arrays, **constants}
        q_chunk, kv_chunk = chunks
        k_all = self._from_devices(lax.all_gather(k, self.axis, axis=2, tiled=True), kv_chunk, self.chunks * kv_chunk)
        v_all = self._from_devices(lax.all_gather(v, self.axis, axis=2, tiled=True), kv_chunk, self.chunks * kv_chunk)
        outs, lses = [], []
        for start, at in self._pieces(lax.axis_index(self.axis), q_chunk):
            args = self._kernel_params(params, start, 0, totals)
            out, lse = self.module.attention(
                q[:, :, at : at + q_chunk], k_all, v_all, scale=scale, return_lse=True, interpret=self.interpret, **args
            )
            outs.append(out)
            lses.append(lse)
        return jnp.concatenate(outs, 2), jnp.concatenate(lses, 2)

    # ------------------------------------------------------------------ ring

    def _ring(self, q, k, v, arrays, *, scale, totals, chunks, constants):
        """On one device: ring attention, a custom VJP (see the module doc). Traced values (the
        arrays, the device index) are arguments or computed inside: the backward is traced apart."""
        blocks = _RingBlocks(self, scale, totals, chunks, constants)
        # The trained params (the backward returns their gradients) apart from the other arrays.
        trained = {name: arrays[name] for name in blocks.trained if name in arrays}
        others = {name: value for name, value in arrays.items() if name not in trained}

        @jax.custom_vjp
        def ring(q, k, v, trained, others):
            return blocks.forward(q, k, v, {**trained, **others})

        def ring_fwd(q, k, v, trained, others):
            out, lse = blocks.forward(q, k, v, {**trained, **others})
            return (out, lse), (q, k, v, trained, others, out, lse)

        def ring_bwd(residuals, cotangents):
            q, k, v, trained, others, out, lse = residuals
            dq, dk, dv, dtrained = blocks.backward(q, k, v, {**trained, **others}, out, lse, *cotangents)
            return dq, dk, dv, dtrained, None  # the other params get no gradient

        ring.defvjp(ring_fwd, ring_bwd)
        return ring(q, k, v, trained, others)


def _when(visible, block, hidden, *operands):
    """block(*operands) where the pair may be visible, else hidden(*shapes of block's results): a
    lax.cond when the answer is traced (the device index decides), plain Python when it is known."""
    skip = lambda *_: hidden(*jax.eval_shape(block, *operands))
    if isinstance(visible, bool):
        return (block if visible else skip)(*operands)
    return lax.cond(visible, block, skip, *operands)


def _add_sink(out, lse, sink):
    """Out and LSE with the sink joined to each row's denominator once (after every block's merge)."""
    total = jnp.logaddexp(lse, sink[..., None])
    shift = jnp.where(jnp.isneginf(total), 0.0, total)
    return (out.astype(jnp.float32) * jnp.exp(lse - shift)[..., None]).astype(out.dtype), total


class _RingBlocks:
    """One device's ring: its query chunks against each K/V block as it comes round."""

    def __init__(self, cp: ContextParallel, scale, totals, chunks, constants):
        self.cp, self.scale, self.totals, self.constants = cp, scale, totals, constants
        self.q_chunk, self.kv_chunk = chunks
        self.next = [(r, (r + 1) % cp.world) for r in range(cp.world)]
        self.trained = getattr(cp.module, "TRAINED_PARAMS", ())  # what its backward returns gradients for, in order

    def _pairs(self, step, arrays):
        """(q slice, kv slice, kernel params, visible) of every chunk pair at ring step `step`;
        visible: whether the mask may show the pair anything (traced: the device index is)."""
        device = lax.axis_index(self.cp.axis)
        source = (device - step) % self.cp.world
        params = {**arrays, **self.constants}
        for q_start, q_at in self.cp._pieces(device, self.q_chunk):
            for kv_start, kv_at in self.cp._pieces(source, self.kv_chunk):
                args = self.cp._kernel_params(params, q_start, kv_start, self.totals)
                visible = self.cp.sharded.visits(
                    (q_start, self.q_chunk), (kv_start, self.kv_chunk), self.totals, params, xp=jnp
                )
                yield slice(q_at, q_at + self.q_chunk), slice(kv_at, kv_at + self.kv_chunk), args, visible

    def forward(self, q, k, v, arrays):
        module = self.cp.module
        out = jnp.zeros((*q.shape[:3], v.shape[3]), jnp.float32)
        lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
        for step in range(self.cp.world):
            for rows, cols, args, visible in self._pairs(step, arrays):

                def block(q, k, v, args=args):
                    return module.attention_forward(q, k, v, scale=self.scale, interpret=self.cp.interpret, **args)

                def hidden(out, lse):  # the mask hides the pair: no key, LSE -inf (the merge's identity)
                    return jnp.zeros(out.shape, out.dtype), jnp.full(lse.shape, -jnp.inf, lse.dtype)

                part, part_lse = _when(visible, block, hidden, q[:, :, rows], k[:, :, cols], v[:, :, cols])
                merged, merged_lse = module.merge_partials(out[:, :, rows], lse[:, :, rows], part, part_lse)
                out, lse = out.at[:, :, rows].set(merged), lse.at[:, :, rows].set(merged_lse)
            if step < self.cp.world - 1:
                k, v = (lax.ppermute(x, self.cp.axis, self.next) for x in (k, v))
        return out.astype(q.dtype), lse

    def backward(self, q, k, v, arrays, out, lse, dout, dlse):
        """(dq, dk, dv, {trained param: this device's share of its gradient})."""
        module = self.cp.module
        dq = jnp.zeros(q.shape, jnp.float32)
        dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
        trained = [name for name in self.trained if name in arrays]
        dparams = {name: jnp.zeros(arrays[name].shape, jnp.float32) for name in trained}
        for step in range(self.cp.world):
            for rows, cols, args, visible in self._pairs(step, arrays):

                def block(dout, dlse, q, k, v, out, lse, args=args):
                    return module.attention_backward(
                        dout, dlse, q, k, v, out, lse, scale=self.scale, interpret=self.cp.interpret, **args
                    )

                def hidden(*grads):
                    return tuple(jnp.zeros(g.shape, g.dtype) for g in grads)

                dq_part, dk_part, dv_part, *dparam_parts = _when(
                    visible, block, hidden, dout[:, :, rows], dlse[:, :, rows], q[:, :, rows], k[:, :, cols],
                    v[:, :, cols], out[:, :, rows], lse[:, :, rows],
                )  # fmt: skip
                dq = dq.at[:, :, rows].add(dq_part.astype(jnp.float32))
                dk = dk.at[:, :, cols].add(dk_part.astype(jnp.float32))
                dv = dv.at[:, :, cols].add(dv_part.astype(jnp.float32))
                dparams = {name: dparams[name] + part.astype(jnp.float32) for name, part in zip(trained, dparam_parts)}
            # The block's sums travel with it; after the last step they are home.
            if step < self.cp.world - 1:
                k, v, dk, dv = (lax.ppermute(x, self.cp.axis, self.next) for x in (k, v, dk, dv))
            else:
                dk, dv = (lax.ppermute(x, self.cp.axis, self.next) for x in (dk, dv))
        dparams = {name: d.astype(arrays[name].dtype) for name, d in dparams.items()}
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dparams
