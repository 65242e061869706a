"""Stage: generated package -> ahead-of-time compile for real GPUs and TPUs, on any machine.

Goals: tell a user on a laptop or a CPU CI runner whether each generated kernel compiles for a
target and fits its limits (shared memory and spills on GPUs; scoped VMEM on TPUs), with one
readable line per kernel and target. Non-goals: running kernels (the tests do that) or timing.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from attngen.build import import_generated, write_package
from attngen.check.gpu import GPU_TARGETS, check_gpu_isolated
from attngen.check.report import Finding
from attngen.spec import Spec

GPU_TARGET_NAMES = tuple(GPU_TARGETS)
TPU_TARGET_NAMES = ("tpu-v5e", "tpu-v5p", "tpu-v6e")
TARGET_NAMES = (*GPU_TARGET_NAMES, *TPU_TARGET_NAMES)
# What `attngen check` compiles when no target is named: the GPUs the tiles were tuned on and
# measured (H200, sm90) or that the README promises (sm80), and the TPUs. Blackwell and AMD
# Instinct are asked for by name (--target): each GPU target adds 5-20 s per spec on a CPU.
DEFAULT_TARGET_NAMES = ("sm90", "sm80", *TPU_TARGET_NAMES)

__all__ = ["DEFAULT_TARGET_NAMES", "TARGET_NAMES", "Finding", "check_spec", "iter_check"]


def check_spec(spec: Spec, targets: tuple[str, ...] = DEFAULT_TARGET_NAMES) -> list[Finding]:
    """Build spec into a scratch folder and compile its kernels for each target."""
    return list(iter_check(spec, targets))


def iter_check(spec: Spec, targets: tuple[str, ...] = DEFAULT_TARGET_NAMES) -> Iterator[Finding]:
    """check_spec, each finding yielded as soon as its compile ends (the CLI shows progress)."""
    unknown = [t for t in targets if t not in TARGET_NAMES]
    if unknown:
        raise ValueError(f"unknown targets {unknown}; choose from {', '.join(TARGET_NAMES)}")
    with tempfile.TemporaryDirectory(prefix="attngen-check-") as tmp:
        write_package(spec, Path(tmp))
        package = Path(tmp) / spec.name
        tag = hashlib.sha256(f"{spec.sha256}:{spec.dtype}".encode()).hexdigest()[:12]
        gpu_targets = [t for t in targets if t in GPU_TARGET_NAMES]
        if gpu_targets:
            yield from check_gpu_isolated(package / "triton_gpu.py", spec.dtype, gpu_targets)
        if any(t in TPU_TARGET_NAMES for t in targets):
            from attngen.check import tpu

            module = import_generated(package / "pallas_tpu.py", f"_attngen_check_{spec.name}_{tag}_pallas")
            for name in targets:
                if name in tpu.TPU_TARGETS:
                    yield from tpu.check_tpu(module, tpu.TPU_TARGETS[name])
