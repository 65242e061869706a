"""What a check finds about one kernel on one target, and how the CLI says it."""

from __future__ import annotations

from dataclasses import dataclass, field

# A stack frame up to this size (bytes per thread: 64 registers' worth) holds a few values, the
# kind ptxas moves out of the way (addresses, loop-invariant terms); larger frames hold tile data.
SMALL_SPILL = 256
# Where a GPU finding's resources hold the spill frame, bytes per thread: NVIDIA's stack frame,
# AMD's scratch (private segment) per lane.
SPILL_KEYS = ("stack_bytes", "scratch_bytes")


@dataclass(frozen=True)
class Finding:
    target: str  # e.g. "sm90", "tpu-v5e"
    kernel: str  # e.g. "fwd", "bwd_dq", "bwd_dkdv"
    blocks: str  # the tile sizes it was built with, e.g. "block_m=128 block_n=64"
    ok: bool
    problem: str = ""  # the limit broken, when not ok
    warning: str = ""
    resources: dict = field(default_factory=dict)  # registers, spills, shared/LDS/VMEM bytes
    note: str = ""  # what else the user should know: e.g. what the kernel falls back to on this target
    skipped: bool = False  # not built for this target (a Hopper-only kernel elsewhere); `note` says why

    def line(self) -> str:
        """One line for the CLI: the failure, the warning and what it means, or the resources used."""
        head = f"{self.target} {self.kernel}" + (f" ({self.blocks})" if self.blocks else "")
        if self.skipped:
            return f"skip {head}: {self.note}"
        if not self.ok:
            return f"FAIL {head}: {self.problem}"
        used = ", ".join(f"{k} {v}" for k, v in self.resources.items())
        note = f"; {self.note}" if self.note else ""
        if self.warning:
            spill = next((self.resources[k] for k in SPILL_KEYS if k in self.resources), 0)
            meaning = spill_meaning(self.target, spill, self.resources.get("spills_by_loop_depth"))
            return f"WARN {head}: {self.warning}{' -- ' + meaning if meaning else ''} [{used}]{note}"
        return f"ok   {head}: {used}{note}"


def spill_meaning(target: str, stack_bytes: int, by_loop_depth: str | None = None) -> str:
    """What a register spill of `stack_bytes` per thread costs, and whether it is worth acting on;
    `by_loop_depth` ("a/b/c", NVIDIA): its spill instructions outside any loop, in loops one deep,
    two deep, ...

    A spilled register lives in local memory (AMD: scratch): each use is a load or store through L1
    (and L2 or HBM when L1 misses) instead of a register read, and it competes with the tiles for
    bandwidth. A spill instruction outside every loop runs once a program; one in the innermost
    loop runs every step of it.
    """
    if not stack_bytes:
        return ""
    depth = by_loop_depth.count("/") if by_loop_depth else 0
    if by_loop_depth and not depth:
        return (
            "how much it matters: little; its spill instructions are all outside the kernel's loops (once a"
            " program); results are exact either way"
        )
    where = ""
    if by_loop_depth:
        deepest = by_loop_depth.rsplit("/", 1)[1]
        loops = f"{depth} loop{'s' * (depth > 1)}"
        sit = "sits" if deepest == "1" else "sit"
        where = f"{deepest} of its spill instructions {sit} {loops} deep (by depth: {by_loop_depth}); "
    if stack_bytes <= SMALL_SPILL:
        return (
            f"how much it matters: {where or 'little; '}{stack_bytes} B per thread is a few values in L1-cached"
            " local memory, usually a few % of the time at most; results are exact either way"
        )
    advice = "pin smaller [triton] tiles or fewer num_warps in the spec, or run `attngen tune` on that GPU"
    if target != "sm90":  # the tuned table's tiles were measured on an H200 (sm90)
        advice = f"tiles from the tuned table were measured on an H200 (sm90), not this GPU: {advice}"
    return (
        f"how much it matters: {where}{stack_bytes} B per thread is likely tile data the loop re-reads from"
        f" local memory, which can make the kernel several times slower (results are exact either way); {advice}"
    )
