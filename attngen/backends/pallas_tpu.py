"""Target: Pallas for TPUs (Mosaic), on jax arrays.

Owns the [pallas_tpu] table (keys, checks, a scoped-VMEM estimate) and declares the Pallas
kernels: the forward, the dQ kernel, the dK/dV kernel and the KV-cache decode kernel.
"""

from dataclasses import dataclass, fields

from attngen.analysis.tiles import BY_KEY_BLOCK, BY_QUERY_BLOCK
from attngen.backends.base import Backend, Counted, Kernel, ProblemShape, Report
from attngen.backends.emit import Dialect


@dataclass(frozen=True)
class PallasTpuConfig:
    block_q: int = 512
    block_kv: int = 512
    vmem_limit_bytes: int | None = None  # None: Mosaic's default scoped VMEM limit


CONFIG_KEYS = tuple(f.name for f in fields(PallasTpuConfig))

# Each kernel declared once. `attngen check` compiles them through the module's jitted entry
# points: _forward, _backward (dQ and dK/dV under one jax.jit) and _decode (contiguous, paged).
KERNELS = (
    Kernel(
        "fwd",
        "training",
        "_fwd_kernel",
        "fwd.py.jinja",
        "Forward: a q block per program row, kv blocks reduced.",
        BY_QUERY_BLOCK,
        "block_kv",
    ),
    Kernel(
        "bwd_dq",
        "training",
        "_dq_kernel",
        "bwd_dq.py.jinja",
        "Backward, dQ: kv blocks reduced per q block.",
        BY_QUERY_BLOCK,
        "block_kv",
    ),
    Kernel(
        "bwd_dkdv",
        "training",
        "_dkdv_kernel",
        "bwd_dkdv.py.jinja",
        "Backward, dK/dV: q blocks reduced per kv block.",
        BY_KEY_BLOCK,
        "block_q",
    ),
    Kernel(
        "decode",
        "kvcache",
        "_decode_kernel",
        "decode.py.jinja",
        "Decoding from a KV cache: the new tokens of every query head of a kv head per program, kv blocks reduced.",
        BY_QUERY_BLOCK,
        "block_kv",
    ),
)


def make_config(table: dict[str, int], shape: ProblemShape | None, report: Report) -> PallasTpuConfig | None:
    """The [pallas_tpu] keys a spec sets, checked against the TPU's tiling and scoped VMEM."""
    report = Counted(report)
    # TPU tiles are (8 sublanes, 128 lanes): q rows are a sublane dim, kv a lane dim of the scores.
    if "block_q" in table and not (table["block_q"] % 8 == 0 and 8 <= table["block_q"] <= 4096):
        report(
            f"pallas_tpu block_q must be a multiple of 8 in 8..4096, got {table['block_q']}",
            "block_q",
            "TPU blocks are tiled by (8, 128)",
        )
    if "block_kv" in table and not (table["block_kv"] % 128 == 0 and 128 <= table["block_kv"] <= 4096):
        report(
            f"pallas_tpu block_kv must be a multiple of 128 in 128..4096, got {table['block_kv']}",
            "block_kv",
            "TPU blocks are tiled by (8, 128)",
        )
    if "vmem_limit_bytes" in table and not 1 << 20 <= table["vmem_limit_bytes"] <= 128 << 20:
        report(
            "pallas_tpu vmem_limit_bytes must be in 1 MiB..128 MiB",
            "vmem_limit_bytes",
            "e.g. vmem_limit_bytes = 33554432 (32 MiB)",
        )
    if report.count or shape is None:  # (no shape: a spec with other problems; values checked only)
        return None
    config = PallasTpuConfig(**table)
    limit = config.vmem_limit_bytes or DEFAULT_VMEM_LIMIT
    itemsize = 4 if shape.dtype == "float32" else 2
    for kernel, need in vmem_estimate(config.block_q, config.block_kv, shape.widest, itemsize).items():
        if need > limit:
            report(
                f"the Pallas {kernel} kernel needs about {need / 2**20:.1f} MiB of VMEM with block_q={config.block_q},"
                f" block_kv={config.block_kv}; the scoped limit is {limit / 2**20:.0f} MiB",
                None,
                "use a smaller block_kv or block_q, or raise vmem_limit_bytes",
            )
            return None
    return config


PALLAS_TPU = Backend(
    name="pallas_tpu",
    template="pallas_tpu/module.py.jinja",
    dialect=Dialect(
        functions={
            "exp": "jnp.exp",
            "log": "jnp.log",
            "sqrt": "jnp.sqrt",
            "tanh": "jnp.tanh",
            "sin": "jnp.sin",
            "cos": "jnp.cos",
            "tan": "jnp.tan",
            "exp2": "jnp.exp2",
            "log2": "jnp.log2",
            "abs": "jnp.abs",
            "min": "jnp.minimum",
            "max": "jnp.maximum",
        },
        where="jnp.where",
        logical_not=lambda x: f"jnp.logical_not({x})",
        to_float=lambda x: f"{x}.astype(jnp.float32)",
        floordiv=None,  # jnp's // and % already floor
        floormod=None,
        load=lambda tensor, indices: f"{tensor}[{', '.join(indices)}]",
        clamp=lambda index, tensor, axis: f"jnp.clip({index}, 0, {tensor}.shape[{axis}] - 1)",  # shapes are static
    ),
    param_prefix="param_",
    kernels=KERNELS,
    config_table="pallas_tpu",
    config_keys=CONFIG_KEYS,
    make_config=make_config,
    symbolic_blocks=False,  # the kernels' blocks are fixed when the package is generated
    helper_functions=frozenset(),
    tensor_args=lambda name, rank: (name,),  # a ref in scalar memory (SMEM)
    gathers_position_loads=True,
    array_module="jnp",
)

# Scoped VMEM a Mosaic kernel may use unless the spec raises it (vmem_limit_bytes): the default
# on v5e and v5p (v6e's is larger).
DEFAULT_VMEM_LIMIT = 16 * 1024 * 1024
_LANES = 128  # a [rows, 1] f32 array occupies [rows, 128] in VMEM


# Query rows of one decode program in the VMEM estimate and `attngen check`: the new tokens of
# every query head of one kv head (e.g. 8 heads x 2 tokens); their number is known only per call.
DECODE_ROWS = 16


def vmem_estimate(
    block_q: int, block_kv: int, head_dim: int, itemsize: int, decode_rows: int = DECODE_ROWS
) -> dict[str, int]:
    """Bytes of scoped VMEM the generated kernels need, per kernel ("fwd", "bwd", "decode").

    Counts what the templates allocate: double-buffered input and output blocks, scratch, and one
    f32 [block_q, block_kv] temporary for each live score-sized value. Within 1% of Mosaic's own
    figure for the forward at block_q=2048, block_kv=4096, head_dim=128, bf16 (43.3 MiB). The
    decode kernel holds decode_rows query rows against a block_kv block of the cache (a paged
    cache's block is made of pages: the same bytes).
    """
    q_tile, kv_tile = block_q * head_dim * itemsize, block_kv * head_dim * itemsize
    row_stat = block_q * _LANES * 4
    scores = block_q * block_kv * 4
    forward = 2 * (q_tile + 2 * kv_tile) + 2 * (q_tile + row_stat) + 2 * row_stat + block_q * head_dim * 4 + scores
    dq = 2 * (2 * q_tile + 2 * kv_tile + 2 * row_stat) + 2 * q_tile + block_q * head_dim * 4 + 2 * scores
    dkdv = 2 * (2 * q_tile + 2 * kv_tile + 2 * row_stat) + 2 * 2 * kv_tile + 2 * block_kv * head_dim * 4 + 2 * scores
    rows_tile, rows_stat = decode_rows * head_dim * itemsize, decode_rows * _LANES * 4
    decode = 2 * (2 * rows_tile + 2 * kv_tile + rows_stat) + 2 * rows_stat + decode_rows * head_dim * 4
    decode += decode_rows * block_kv * 4
    return {"fwd": forward, "bwd": max(dq, dkdv), "decode": decode}
