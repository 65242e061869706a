"""Target: Triton for NVIDIA (and AMD) GPUs, on torch tensors."""

import json
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from attngen.backends.base import Backend
from attngen.backends.emit import Dialect


def tensor_args(name: str, rank: int) -> tuple[str, ...]:
    """A tensor param reaches the kernels as its (contiguous) data and the size of each axis;
    the template's load_<name> helper reads elements (the printer clamps the indices)."""
    return (name, *(f"{name}_size{axis}" for axis in range(rank)))


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
        load=lambda tensor, indices: f"load_{tensor}({', '.join(tensor_args(tensor, len(indices)) + tuple(indices))})",
        clamp=lambda index, tensor, axis: f"clamped({index}, {tensor}_size{axis})",
    ),
    param_prefix="param_",
    block_kv_key="block_n",
    dq_block_kv_key="dq_block_n",
    dkdv_block_q_key="dkdv_block_m",
    block_names=("BLOCK_N", "BLOCK_N", "BLOCK_M"),  # each kernel's own constexprs
    helper_functions=frozenset({"tanh", "floordiv", "floormod"}),
    tensor_args=tensor_args,
    gathers_position_loads=False,
)


# ----------------------------------------------------------------------------- tuned defaults
# Specs that do not pin their [triton] keys take them from a table of measured winners, per
# (GPU, head_dim, dtype), written by `attngen tune` (attngen/tune.py) and committed with the code,
# so that builds stay deterministic. A build targets the table's default_gpu.

TUNED_TABLE = Path(__file__).resolve().parent / "triton_tuned.toml"
_HEADER = (
    "# Triton kernel configurations measured fastest per (GPU, head_dim, dtype): written by\n"
    "# `attngen tune`, read by `attngen build` for specs that do not pin their [triton] keys.\n"
    "# A spec of head_dim D takes the entry of its dtype with the smallest head_dim >= D.\n"
)


@dataclass(frozen=True)
class TunedEntry:
    gpu: str
    head_dim: int
    dtype: str
    config: dict[str, int]  # every TritonConfig field


def _load_table(path: Path | None = None) -> tuple[str, tuple[TunedEntry, ...]]:
    return _read_table(path or TUNED_TABLE)


@cache  # every spec parse asks for defaults: read the file once (write_tuned_table forgets it)
def _read_table(path: Path) -> tuple[str, tuple[TunedEntry, ...]]:
    with path.open("rb") as f:
        data = tomllib.load(f)
    return data["default_gpu"], tuple(
        TunedEntry(e.pop("gpu"), e.pop("head_dim"), e.pop("dtype"), e) for e in data["entry"]
    )


def default_config(head_dim: int, dtype: str) -> dict[str, int]:
    """[triton] values for a spec of this head_dim and dtype that does not set them."""
    gpu, entries = _load_table()
    fitting = [e for e in entries if e.gpu == gpu and e.dtype == dtype and e.head_dim >= head_dim]
    if not fitting:
        raise ValueError(f"{TUNED_TABLE.name} has no {gpu} entry for {dtype} with head_dim >= {head_dim}")
    return dict(min(fitting, key=lambda e: e.head_dim).config)


def write_tuned_table(new: list[TunedEntry], path: Path | None = None) -> None:
    """Merge `new` into the table (replacing entries of the same GPU, head_dim and dtype)."""
    path = path or TUNED_TABLE
    gpu, entries = _load_table(path)
    keys = {(e.gpu, e.head_dim, e.dtype) for e in new}
    merged = sorted(
        [e for e in entries if (e.gpu, e.head_dim, e.dtype) not in keys] + list(new),
        key=lambda e: (e.gpu, e.dtype, e.head_dim),
    )
    lines = [_HEADER, f"default_gpu = {json.dumps(gpu)}"]
    for e in merged:
        lines += [
            "",
            "[[entry]]",
            f"gpu = {json.dumps(e.gpu)}",
            f"head_dim = {e.head_dim}",
            f"dtype = {json.dumps(e.dtype)}",
        ]
        lines += [f"{key} = {int(value)}" for key, value in e.config.items()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
    _read_table.cache_clear()
