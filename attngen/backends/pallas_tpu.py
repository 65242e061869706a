"""Target: Pallas for TPUs (Mosaic), on jax arrays."""

from attngen.backends.base import Backend
from attngen.backends.emit import Dialect

PALLAS_TPU = Backend(
    name="pallas_tpu",
    template="pallas_tpu/attention.py.jinja",
    dialect=Dialect(
        functions={
            "exp": "jnp.exp",
            "log": "jnp.log",
            "sqrt": "jnp.sqrt",
            "tanh": "jnp.tanh",
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
    block_kv_key="block_kv",
    dq_block_kv_key="block_kv",
    dkdv_block_q_key="block_q",
    block_names=None,  # the kernels' blocks are fixed when the package is generated
    helper_functions=frozenset(),
    tensor_args=lambda name, rank: (name,),  # a ref in scalar memory (SMEM)
    gathers_position_loads=True,
)

# Scoped VMEM a Mosaic kernel may use unless the spec raises it (vmem_limit_bytes): the default
# on v5e and v5p (v6e's is larger).
DEFAULT_VMEM_LIMIT = 16 * 1024 * 1024
_LANES = 128  # a [rows, 1] f32 array occupies [rows, 128] in VMEM


def vmem_estimate(block_q: int, block_kv: int, head_dim: int, itemsize: int) -> dict[str, int]:
    """Bytes of scoped VMEM the generated forward and backward kernels need, per kernel.

    Counts what the templates allocate: double-buffered input and output blocks, scratch, and one
    f32 [block_q, block_kv] temporary for each live score-sized value. Within 1% of Mosaic's own
    figure for the forward at block_q=2048, block_kv=4096, head_dim=128, bf16 (43.3 MiB).
    """
    q_tile, kv_tile = block_q * head_dim * itemsize, block_kv * head_dim * itemsize
    row_stat = block_q * _LANES * 4
    scores = block_q * block_kv * 4
    forward = 2 * (q_tile + 2 * kv_tile) + 2 * (q_tile + row_stat) + 2 * row_stat + block_q * head_dim * 4 + scores
    dq = 2 * (2 * q_tile + 2 * kv_tile + 2 * row_stat) + 2 * q_tile + block_q * head_dim * 4 + 2 * scores
    dkdv = 2 * (2 * q_tile + 2 * kv_tile + 2 * row_stat) + 2 * 2 * kv_tile + 2 * block_kv * head_dim * 4 + 2 * scores
    return {"fwd": forward, "bwd": max(dq, dkdv)}
