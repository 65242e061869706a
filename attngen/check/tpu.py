"""Ahead-of-time compile of the generated Pallas kernels for TPUs, on a CPU machine.

With libtpu installed (the `tpu` extra), jax.experimental.topologies describes a TPU slice
without one, and lower(...).compile() runs the real Mosaic compiler against it: scoped-VMEM
overflows and layout errors show up here, not on the TPU. Without libtpu the kernels are only
lowered to Mosaic (jax.export for platform "tpu"), which still catches block-shape errors.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from attngen.backends.pallas_tpu import DECODE_ROWS, DEFAULT_VMEM_LIMIT, vmem_estimate
from attngen.check.report import Finding


@dataclass(frozen=True)
class TpuTarget:
    name: str
    topology: str  # for jax.experimental.topologies.get_topology_desc


TPU_TARGETS = {
    "tpu-v5e": TpuTarget("tpu-v5e", "v5e:2x2"),
    "tpu-v5p": TpuTarget("tpu-v5p", "v5p:2x2x1"),
    "tpu-v6e": TpuTarget("tpu-v6e", "v6e:2x2"),
}


def _device(target: TpuTarget):
    """A device of the target's topology, or None without libtpu."""
    # libtpu takes a machine-wide lock on load; compiling needs no TPU, so let checks run side
    # by side (two `attngen check` runs, or a check beside the tests).
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        with _libtpu_notice_held_back():
            return topologies.get_topology_desc(target.topology, platform="tpu").devices[0]
    except Exception:  # noqa: BLE001  (no libtpu, or it cannot describe this chip)
        return None


# What libtpu logs when it starts on a machine with no TPU (it asks the cloud metadata server about
# this host's TPU, finds none, and says so, as E0000 ... INVALID_ARGUMENT ... TPU_WORKER_HOSTNAMES).
# Describing a topology needs no TPU of this host, so the notice is noise here: it is dropped, and
# with it the trace lines that follow it; anything else libtpu says is passed on.
_NO_TPU_HERE = re.compile(r"could not determine TPU|Logging before InitGoogle\(\)")
_TRACE_LINE = re.compile(r"=== Source Location Trace: ===|\S+\.cc:\d+$")


@contextlib.contextmanager
def _libtpu_notice_held_back():
    """Capture stderr (the file descriptor: libtpu writes from C++) while libtpu may start, then
    write back every line except its no-TPU-here notice."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as captured:
            os.dup2(captured.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                captured.seek(0)
                text = captured.read().decode(errors="replace")
    finally:
        os.close(saved)
    kept, in_notice = [], False
    for line in text.splitlines():
        if _NO_TPU_HERE.search(line) or (in_notice and _TRACE_LINE.match(line.strip())):
            in_notice = True
            continue
        kept.append(line)
        in_notice = False
    if kept:
        print("\n".join(kept), file=sys.stderr)


def _problem(module, device):
    """Abstract inputs of each kernel: two blocks of each kind, so tails and tiling are real; the
    decode kernel with DECODE_ROWS query rows (4 new tokens of 4 query heads per kv head) against a
    cache of two kv blocks, contiguous and in pages of 16 keys (the most pages per block)."""
    import jax
    import jax.numpy as jnp

    length = 2 * max(module.BLOCK_Q, module.BLOCK_KV)
    sharding = jax.sharding.SingleDeviceSharding(device) if device is not None else None

    def array(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    tile = array((1, 1, length, module.HEAD_DIM), module.DTYPE)
    tile_v = array((1, 1, length, module.HEAD_DIM_V), module.DTYPE)  # v, out and dout
    stats = array((1, 1, length), jnp.float32)
    scalars = (array((len(module.PARAMS) + 1,), jnp.int32), array((len(module.PARAMS) + 1,), jnp.float32))
    # Tensor params at the problem's sizes (a free axis: 8), and the tiles gathered from them.
    tensors = getattr(module, "TENSOR_PARAMS", {})

    def smem(sizes):
        return tuple(
            array(
                tuple(axis if isinstance(axis, int) else sizes.get(axis, 8) for axis in tensors[name][1]),
                jnp.float32 if tensors[name][0] is float else jnp.int32,  # bool tensors travel as int32
            )
            for name in getattr(module, "SMEM_TENSORS", ())
        )

    gathered = tuple(
        array((1, 1, length if axes[2] else 1, length if axes[3] else 1), dtype)
        for dtype, axes in getattr(module, "GATHERED", ())
    )
    # A mask that reads tensors at each position comes with a table of tile classes (2 x 2 blocks).
    classes = (array((1, 1, 2, 2), jnp.int32),) if hasattr(module, "_tile_classes") else ()
    prefetch = (*scalars, *smem({"batch": 1, "heads": 1, "kv_heads": 1, "q_len": length, "kv_len": length}), *classes)
    # Decode: one slot of q rows [1, kv_heads, DECODE_ROWS, D], heads // kv_heads x new_tokens rows.
    kv_heads, new_tokens, capacity, page_size = 2, 4, 2 * module.BLOCK_KV, 16
    heads = kv_heads * DECODE_ROWS // new_tokens
    decode_q = array((1, kv_heads, DECODE_ROWS, module.HEAD_DIM), module.DTYPE)
    decode_sizes = {"batch": 1, "heads": heads, "kv_heads": kv_heads, "q_len": capacity, "kv_len": capacity}
    one = array((1,), jnp.int32)
    descales = array((kv_heads * 2,), jnp.float32)
    decode_scalars = (*scalars, *smem(decode_sizes), one, one, one, one, descales)  # lengths, starts, slots, descales
    decode = functools.partial(module._decode, new_tokens=new_tokens)
    decode_gathered = tuple(
        array(shape, dtype)
        for shape, dtype in (
            module._decode_gathered_shapes(1, kv_heads, DECODE_ROWS, capacity) if hasattr(module, "GATHERED") else ()
        )
    )

    def cache(rows, width):
        return array((rows, kv_heads, capacity // rows, width), module.DTYPE)  # 1 sequence, or its pages

    contiguous = (cache(1, module.HEAD_DIM), cache(1, module.HEAD_DIM_V), (*decode_scalars, array((1,), jnp.int32)))
    table = array((1, capacity // page_size), jnp.int32)
    pages = capacity // page_size
    paged = (cache(pages, module.HEAD_DIM), cache(pages, module.HEAD_DIM_V), (*decode_scalars, table))
    return {
        "fwd": (module._forward, (tile, tile, tile_v, prefetch, gathered)),
        "bwd": (module._backward, (tile_v, stats, tile, tile, tile_v, tile_v, stats, prefetch, gathered)),
        "decode": (decode, (decode_q, *contiguous, decode_gathered)),
        "decode_paged": (decode, (decode_q, *paged, decode_gathered)),
    }


def check_tpu(module, target: TpuTarget) -> Iterator[Finding]:
    """Compile each Pallas kernel for `target`, yielding each finding as it is known."""
    import jax
    import jax.numpy as jnp

    device = _device(target)
    limit = module.VMEM_LIMIT_BYTES or DEFAULT_VMEM_LIMIT
    estimate = vmem_estimate(module.BLOCK_Q, module.BLOCK_KV, module.HEAD_DIM, jnp.dtype(module.DTYPE).itemsize)
    estimate["decode_paged"] = estimate["decode"]  # a paged kv block: the same rows, in pages
    blocks = f"block_q={module.BLOCK_Q} block_kv={module.BLOCK_KV}"
    for kernel, (fn, args) in _problem(module, device).items():
        resources = {"vmem_estimate": f"{estimate[kernel] / 2**20:.1f} MiB", "vmem_limit": f"{limit / 2**20:.0f} MiB"}
        try:
            if device is None:
                jax.export.export(jax.jit(fn, static_argnames=("interpret",)), platforms=["tpu"])(
                    *args, interpret=False
                )
            else:
                with jax.default_device(device):  # Mosaic's lowering asks the default device its chip
                    lowered = jax.jit(fn, static_argnames=("interpret",)).trace(*args, interpret=False)
                    lowered.lower(lowering_platforms=("tpu",)).compile()
        except Exception as e:  # noqa: BLE001  (any compiler failure is the finding)
            yield Finding(
                target.name,
                kernel,
                blocks,
                ok=False,
                problem=_explain(str(e), estimate[kernel]),
                resources=resources,
            )
            continue
        warning = (
            "" if device is not None else "lowered to Mosaic only: install the tpu extra (libtpu) for the real compile"
        )
        yield Finding(target.name, kernel, blocks, ok=True, warning=warning, resources=resources)


def _explain(message: str, estimate: int) -> str:
    """One line for a Mosaic failure."""
    oom = re.search(r"Scoped allocation with size ([\d.]+\w) and limit ([\d.]+\w)", message)
    if oom:
        return (
            f"scoped VMEM {oom.group(1)}B > limit {oom.group(2)}B (attngen's estimate {estimate / 2**20:.1f} MiB):"
            " use a smaller block_kv or block_q, or raise vmem_limit_bytes"
        )
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return f"does not compile: {lines[0] if lines else 'unknown error'}"
