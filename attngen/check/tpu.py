"""Ahead-of-time compile of the generated Pallas kernels for TPUs, on a CPU machine.

With libtpu installed (the `tpu` extra), jax.experimental.topologies describes a TPU slice
without one, and lower(...).compile() runs the real Mosaic compiler against it: scoped-VMEM
overflows and layout errors show up here, not on the TPU. Without libtpu the kernels are only
lowered to Mosaic (jax.export for platform "tpu"), which still catches block-shape errors.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from attngen.backends.pallas_tpu import DEFAULT_VMEM_LIMIT, vmem_estimate
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
        return topologies.get_topology_desc(target.topology, platform="tpu").devices[0]
    except Exception:  # noqa: BLE001  (no libtpu, or it cannot describe this chip)
        return None


def _problem(module, device):
    """Abstract inputs of both kernels: two blocks of each kind, so tails and tiling are real."""
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
    sizes = {"batch": 1, "heads": 1, "kv_heads": 1, "q_len": length, "kv_len": length}
    tensors = getattr(module, "TENSOR_PARAMS", {})
    smem = tuple(
        array(
            tuple(axis if isinstance(axis, int) else sizes.get(axis, 8) for axis in tensors[name][1]),
            jnp.int32 if tensors[name][0] is int else jnp.float32,
        )
        for name in getattr(module, "SMEM_TENSORS", ())
    )
    gathered = tuple(
        array((1, 1, length if axes[2] else 1, length if axes[3] else 1), dtype)
        for dtype, axes in getattr(module, "GATHERED", ())
    )
    # A mask that reads tensors at each position comes with a table of tile classes (2 x 2 blocks).
    classes = (array((1, 1, 2, 2), jnp.int32),) if hasattr(module, "_tile_classes") else ()
    prefetch = (*scalars, *smem, *classes)
    return {
        "fwd": (module._forward, (tile, tile, tile_v, prefetch, gathered)),
        "bwd": (module._backward, (tile_v, stats, tile, tile, tile_v, tile_v, stats, prefetch, gathered)),
    }


def check_tpu(module, target: TpuTarget) -> list[Finding]:
    import jax
    import jax.numpy as jnp

    device = _device(target)
    limit = module.VMEM_LIMIT_BYTES or DEFAULT_VMEM_LIMIT
    estimate = vmem_estimate(module.BLOCK_Q, module.BLOCK_KV, module.HEAD_DIM, jnp.dtype(module.DTYPE).itemsize)
    blocks = f"block_q={module.BLOCK_Q} block_kv={module.BLOCK_KV}"
    findings = []
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
            findings.append(
                Finding(
                    target.name,
                    kernel,
                    blocks,
                    ok=False,
                    problem=_explain(str(e), estimate[kernel]),
                    resources=resources,
                )
            )
            continue
        warning = (
            "" if device is not None else "lowered to Mosaic only: install the tpu extra (libtpu) for the real compile"
        )
        findings.append(Finding(target.name, kernel, blocks, ok=True, warning=warning, resources=resources))
    return findings


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
