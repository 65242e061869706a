"""What a target is: a name, the file it writes, its template and how it spells expressions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from attngen.backends.emit import Dialect


@dataclass(frozen=True)
class Backend:
    name: str  # e.g. "triton_gpu"; also the module name in the generated package
    template: str  # path under templates/
    dialect: Dialect  # templates name q_idx, kv_idx, b, h, score and the tile variables as the IR does
    param_prefix: str  # kernels read param `x` as f"{param_prefix}{x}" (never shadows a name)
    # Which config fields size the blocks a tile analysis depends on: the kv step of the forward
    # and of the dQ kernel (per q block), and the q step of the dK/dV kernel (per kv block).
    block_kv_key: str
    dq_block_kv_key: str
    dkdv_block_q_key: str
    # Or, where the kernels take block sizes as compile-time arguments, the names of those
    # arguments in the same order: the bounds then read them, and a launch may pick the sizes.
    block_names: tuple[str, str, str] | None
    helper_functions: frozenset[str]  # dialect functions the template defines only when used
    # What a kernel takes for a tensor param: (its name in kernels, its rank) -> argument names.
    tensor_args: Callable[[str, int], tuple[str, ...]]
    # Whether loads at per-position indices (q_idx, kv_idx) are materialised before the kernels
    # into score-shaped tiles (TPUs have no general gather), rather than read in the kernels.
    gathers_position_loads: bool

    @property
    def filename(self) -> str:
        return f"{self.name}.py"
