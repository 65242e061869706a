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

from attngen.backends.base import Arg, Kernel
from attngen.backends.triton_gpu import TILE_KEYS, TRITON_GPU
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

_ELEMENT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


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


def _tiles(module, kernel: Kernel) -> dict[str, int]:
    """block_m, block_n, num_warps and num_stages of `kernel`, as the module's constants hold them."""
    return {key: getattr(module, f"{kernel.tiles}{key}".upper()) for key in TILE_KEYS}


def _signature(module, kernel: Kernel, dtype: str):
    """Argument types as a launch on contiguous tensors would specialise them, read off the kernel's
    declaration by argument name (so no argument order is repeated here)."""
    fn = getattr(module, kernel.function)
    tiles = _tiles(module, kernel)
    constexpr_values = {
        **dict(kernel.constexprs),
        "BLOCK_M": tiles["block_m"],
        "BLOCK_N": tiles["block_n"],
        "BLOCK_D": module.BLOCK_D,
        "BLOCK_DV": module.BLOCK_DV,
        "HEAD_DIM": module.HEAD_DIM,
        "HEAD_DIM_V": module.HEAD_DIM_V,
    }
    widths = {"d": module.BLOCK_D, "dv": module.BLOCK_DV}
    tensors = getattr(module, "TENSOR_PARAMS", {})
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        declared = kernel.argument(name)
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", constexpr_values[name]
        elif declared is not None and declared.kind == "desc":
            rows = constexpr_values[declared.rows]
            signature[name] = f"tensordesc<{_ELEMENT[dtype]}[1,1,{rows},{widths[declared.width]}]>"
        elif declared is not None:
            signature[name] = f"*{_ELEMENT[dtype]}" if declared.kind == "*in" else declared.kind
        # What the spec adds after the declared arguments: block tables, then its params.
        elif name == "TABLES":  # block tables of a mask that reads tensors (_block_tables)
            signature[name], declared = "*i32", Arg("*i32", divisible=True)
        elif name.startswith("tables_stride_"):
            signature[name] = "i32"
        elif name.removeprefix("param_") in tensors:  # a tensor param's data
            signature[name] = "*fp32" if tensors[name.removeprefix("param_")][0] is float else "*i32"
            declared = Arg(signature[name], divisible=True)
        elif name.removeprefix("param_") in module.PARAMS:
            signature[name] = "fp32" if module.PARAMS[name.removeprefix("param_")] is float else "i32"
        elif name.startswith("param_"):  # a tensor param's axis size
            signature[name] = "i32"
        else:
            raise ValueError(f"{kernel.function} takes `{name}`, which neither its declaration nor the spec names")
        if declared is not None and declared.divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return fn, signature, constexprs, attrs


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
    for kernel in TRITON_GPU.kernels:
        if kernel.enabled_by and not getattr(module, kernel.enabled_by.upper()):  # e.g. no short forward
            continue
        name, tiles = kernel.name, _tiles(module, kernel)
        warps, stages = tiles["num_warps"], tiles["num_stages"]
        blocks = " ".join(f"{key}={value}" for key, value in tiles.items())
        fn, signature, constexprs, attrs = _signature(module, kernel, dtype)
        try:
            compiled = triton.compile(
                ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                target=GPUTarget("cuda", target.capability, 32),
                options={"num_warps": warps, "num_stages": stages},
            )
        except Exception as e:  # noqa: BLE001  (any compiler failure is the finding)
            message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            findings.append(Finding(target.name, name, blocks, ok=False, problem=f"does not compile: {message}"))
            continue
        shared = compiled.metadata.shared
        resources = {"shared": f"{shared / 1024:.0f} KiB", **_resource_usage(compiled.asm["cubin"])}
        if shared > target.max_shared:
            problem = (
                f"shared memory {shared / 1024:.0f} KiB > {target.max_shared / 1024:.0f} KiB per block"
                f" (smaller blocks or fewer {kernel.tiles}num_stages)"
            )
            findings.append(Finding(target.name, name, blocks, ok=False, problem=problem, resources=resources))
            continue
        spills = resources.get("stack_bytes", 0)
        warning = (
            f"registers spill to a {spills}-byte stack frame (slow; try fewer warps or smaller blocks)"
            if spills
            else ""
        )
        findings.append(Finding(target.name, name, blocks, ok=True, warning=warning, resources=resources))
    return findings


def main(argv: list[str]) -> None:
    path, dtype, *targets = argv
    module = import_generated(Path(path), "_attngen_check_triton_gpu")
    for name in targets:
        for finding in check_gpu(module, dtype, GPU_TARGETS[name]):
            print(json.dumps(dataclasses.asdict(finding)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
