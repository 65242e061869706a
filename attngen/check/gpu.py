"""Ahead-of-time compile of the generated Triton kernels for NVIDIA GPUs, on a CPU machine.

Triton compiles for a GPUTarget without a GPU (ptxas ships with it), but it checks shared memory
only when a kernel is loaded onto a device; this module checks it against the target's per-block
limit, and reads registers and the stack frame (spills) of the cubin with cuobjdump.

It runs in a process of its own (`python -m attngen.check.gpu MODULE DTYPE TARGET...`, one JSON
finding per line), so that compiling never mixes with a process that runs kernels under
TRITON_INTERPRET or has registered the same torch ops.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from attngen.build import import_generated
from attngen.check.report import Finding


@dataclass(frozen=True)
class GpuTarget:
    name: str
    capability: int
    max_shared: int  # bytes of shared memory one block may use (opt-in maximum)


GPU_TARGETS = {
    "sm90": GpuTarget("sm90", 90, 227 * 1024),
    "sm80": GpuTarget("sm80", 80, 163 * 1024),
}

_POINTER = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32"}
# (kernel function, what its pointer arguments hold: "x" the input dtype, "f" float32 stats)
_KERNELS = {
    "fwd": ("_attention_fwd", "xxxxf", "NUM_STAGES"),
    "bwd_dq": ("_attention_bwd_dq", "xxxxffx", "BWD_NUM_STAGES"),
    "bwd_dkdv": ("_attention_bwd_dkdv", "xxxxffxx", "BWD_NUM_STAGES"),
}


def check_gpu_isolated(path: Path, dtype: str, targets: list[str]) -> list[Finding]:
    """check_gpu for each target, in a fresh Python process compiling for real GPUs."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run(
        [sys.executable, "-m", "attngen.check.gpu", str(path), dtype, *targets],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the GPU check of {path} failed:\n{result.stderr[-2000:]}")
    return [Finding(**json.loads(line)) for line in result.stdout.splitlines() if line.startswith("{")]


def _signature(module, fn, pointers: str, dtype: str):
    """Argument types as a launch on contiguous tensors would specialise them."""
    import triton.language as tl  # noqa: F401  (triton must be importable)

    signature, constexprs, attrs = {}, {}, {}
    pointer_types = iter(_POINTER[dtype] if p == "x" else "*fp32" for p in pointers)
    blocks = {
        "BLOCK_M": module.BLOCK_M,
        "BLOCK_N": module.BLOCK_N,
        "BLOCK_D": module.BLOCK_D,
        "HEAD_DIM": module.HEAD_DIM,
    }
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", blocks[name]
        elif name.startswith("stride") and name.endswith("d"):  # the contiguous last dim: stride 1
            signature[name], constexprs[name] = "constexpr", 1
        elif name.startswith("stride") or name == "num_heads":
            signature[name], attrs[(index,)] = "i32", [["tt.divisibility", 16]]
        elif name in ("scale",) or module.PARAMS.get(name.removeprefix("param_")) is float:
            signature[name] = "fp32"
        elif name in ("q_len", "kv_len") or name.startswith("param_"):
            signature[name] = "i32"
        else:
            signature[name], attrs[(index,)] = next(pointer_types), [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack frame (bytes; > 0 means spills) of the cubin Triton built."""
    from triton.backends import nvidia

    cuobjdump = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        report = subprocess.run(
            [cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        )
    usage = re.search(r"REG:(\d+) STACK:(\d+)", report.stdout)
    return {"registers": int(usage.group(1)), "stack_bytes": int(usage.group(2))} if usage else {}


def check_gpu(module, dtype: str, target: GpuTarget) -> list[Finding]:
    """Compile each kernel of a generated triton_gpu module for `target`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    findings = []
    for kernel, (fn_name, pointers, stages_name) in _KERNELS.items():
        fn = getattr(module, fn_name)
        stages = getattr(module, stages_name)
        blocks = f"block_m={module.BLOCK_M} block_n={module.BLOCK_N} num_warps={module.NUM_WARPS} num_stages={stages}"
        signature, constexprs, attrs = _signature(module, fn, pointers, dtype)
        try:
            compiled = triton.compile(
                ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", target.capability, 32),
                options={"num_warps": module.NUM_WARPS, "num_stages": stages},
            )
        except Exception as e:  # noqa: BLE001  (any compiler failure is the finding)
            message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            findings.append(Finding(target.name, kernel, blocks, ok=False, problem=f"does not compile: {message}"))
            continue
        shared = compiled.metadata.shared
        resources = {"shared": f"{shared / 1024:.0f} KiB", **_resource_usage(compiled.asm["cubin"])}
        if shared > target.max_shared:
            problem = (
                f"shared memory {shared / 1024:.0f} KiB > {target.max_shared / 1024:.0f} KiB per block"
                f" (smaller block_m/block_n or fewer {stages_name.lower()})"
            )
            findings.append(Finding(target.name, kernel, blocks, ok=False, problem=problem, resources=resources))
            continue
        spills = resources.get("stack_bytes", 0)
        warning = (
            f"registers spill to a {spills}-byte stack frame (slow; try fewer warps or smaller blocks)"
            if spills
            else ""
        )
        findings.append(Finding(target.name, kernel, blocks, ok=True, warning=warning, resources=resources))
    return findings


def main(argv: list[str]) -> None:
    path, dtype, *targets = argv
    module = import_generated(Path(path), "_attngen_check_triton_gpu")
    for name in targets:
        for finding in check_gpu(module, dtype, GPU_TARGETS[name]):
            print(json.dumps(dataclasses.asdict(finding)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
