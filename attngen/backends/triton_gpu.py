"""Target: Triton for NVIDIA (and AMD) GPUs, on torch tensors."""

from attngen.backends.base import Backend
from attngen.backends.emit import Dialect

TRITON_GPU = Backend(
    name="triton_gpu",
    template="triton/attention.py.jinja",
    dialect=Dialect(
        functions={
            "exp": "tl.exp",
            "log": "tl.log",
            "sqrt": "tl.sqrt",
            "tanh": "tanh",  # helper: libdevice is unavailable under TRITON_INTERPRET
            "abs": "tl.abs",
            "min": "tl.minimum",
            "max": "tl.maximum",
        },
        where="tl.where",
        logical_not=lambda x: f"~{x}",
        to_float=lambda x: f"{x}.to(tl.float32)",
        floordiv="floordiv",  # helpers: Triton's // and % truncate toward zero
        floormod="floormod",
    ),
    param_prefix="param_",
    block_q_key="block_m",
    block_kv_key="block_n",
    helper_functions=frozenset({"tanh", "floordiv", "floormod"}),
)
