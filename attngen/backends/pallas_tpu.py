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
    ),
    param_prefix="param_",
    block_q_key="block_q",
    block_kv_key="block_kv",
    helper_functions=frozenset(),
)
