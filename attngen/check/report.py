"""What a check finds about one kernel on one target."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Finding:
    target: str  # e.g. "sm90", "tpu-v5e"
    kernel: str  # e.g. "fwd", "bwd_dq", "bwd_dkdv"
    blocks: str  # the tile sizes it was built with, e.g. "block_m=128 block_n=64"
    ok: bool
    problem: str = ""  # the limit broken, when not ok
    warning: str = ""
    resources: dict = field(default_factory=dict)  # registers, spills, shared/VMEM bytes

    def line(self) -> str:
        """One line for the CLI: the failure, the warning, or the resources used."""
        head = f"{self.target} {self.kernel} ({self.blocks})"
        if not self.ok:
            return f"FAIL {head}: {self.problem}"
        used = ", ".join(f"{k} {v}" for k, v in self.resources.items())
        if self.warning:
            return f"WARN {head}: {self.warning} [{used}]"
        return f"ok   {head}: {used}"
