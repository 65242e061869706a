"""Ahead-of-time compile of the generated Triton kernels for NVIDIA and AMD GPUs, on a CPU machine.

Triton compiles for a GPUTarget without a GPU (ptxas and the AMDGPU LLVM backend ship with it), but
it checks shared memory (AMD: LDS) only when a kernel is loaded onto a device; this module checks
it against the target's per-block limit, and reads registers and spills from the binary: the
cubin's with cuobjdump, the hsaco's from the code-object metadata in its amdgcn text.

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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from attngen.backends.base import FP8, Arg, Kernel
from attngen.backends.triton_gpu import SM90_SHARED_BYTES, TILE_KEYS, TRITON_GPU
from attngen.build import import_generated
from attngen.check import sass
from attngen.check.report import Finding


@dataclass(frozen=True)
class GpuTarget:
    name: str
    backend: str  # Triton's: "cuda" (builds a cubin) or "hip" (an hsaco, for AMD)
    arch: int | str  # a CUDA compute capability (90) or an AMD LLVM target ("gfx942")
    warp_size: int  # threads of a warp (AMD: wavefront)
    max_shared: int  # bytes of shared memory (AMD: LDS) one block (AMD: workgroup) may use

    @property
    def capability(self) -> int | None:
        """The CUDA compute capability that Kernel.capabilities names; None on AMD."""
        return self.arch if self.backend == "cuda" else None

    @property
    def memory(self) -> str:
        return "shared memory" if self.backend == "cuda" else "LDS"


# Per-block limits. NVIDIA: the opt-in maximum, the SM's shared memory less the 1 KiB the driver
# reserves per block (CUDA C++ Programming Guide, "Compute Capabilities", technical specifications
# per compute capability; the same figures as NVIDIA/cccl's cuda/__device/arch_traits.h: 164, 228,
# 228 and 100 KiB per SM on sm80, sm90, sm100 and sm120). AMD: the compute unit's LDS, all of which
# one workgroup may use (ROCm documentation, "AMD GPU specifications": 64 KiB on CDNA3, 160 KiB on
# CDNA4). sm100 and later are opt-in targets of `attngen check` (see attngen.check).
GPU_TARGETS = {
    "sm90": GpuTarget("sm90", "cuda", 90, 32, SM90_SHARED_BYTES),  # H100, H200
    "sm80": GpuTarget("sm80", "cuda", 80, 32, 163 * 1024),  # A100
    "sm100": GpuTarget("sm100", "cuda", 100, 32, 227 * 1024),  # B200, GB200: datacenter Blackwell
    "sm120": GpuTarget("sm120", "cuda", 120, 32, 99 * 1024),  # RTX 50 series, RTX PRO 6000: consumer Blackwell
    "gfx942": GpuTarget("gfx942", "hip", "gfx942", 64, 64 * 1024),  # MI300X, MI325X (CDNA3)
    "gfx950": GpuTarget("gfx950", "hip", "gfx950", 64, 160 * 1024),  # MI350X, MI355X (CDNA4)
}

_ELEMENT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", FP8: "fp8e4nv"}
_GLUON_ELEMENT = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", FP8: "float8e4nv"}


def check_gpu_isolated(path: Path, dtype: str, targets: list[str]) -> Iterator[Finding]:
    """check_gpu for each target, in a fresh Python process compiling for real GPUs; each finding
    is yielded as soon as the process prints it, so the CLI can show progress."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    # stderr goes to a file, not a pipe: a pipe nobody reads while we read stdout could fill and block the child.
    with tempfile.TemporaryFile(mode="w+") as stderr:
        with subprocess.Popen(
            [sys.executable, "-m", "attngen.check.gpu", str(path), dtype, *targets],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        ) as process:
            for line in process.stdout:
                if line.startswith("{"):
                    yield Finding(**json.loads(line))
        if process.returncode != 0:
            stderr.seek(0)
            raise RuntimeError(f"the GPU check of {path} failed:\n{stderr.read()[-2000:]}")


def _has_tma(target: GpuTarget) -> bool:
    """Whether a generated module's Triton kernels move tiles with tensor descriptors on `target`,
    as its _tma decides: everywhere but NVIDIA GPUs before Hopper."""
    return target.backend != "cuda" or target.arch >= 90


def _tiles(module, kernel: Kernel, tma: bool = True) -> dict[str, int]:
    """block_m, block_n, num_warps and num_stages of `kernel`, as the module's constants hold them;
    without TMA (NVIDIA GPUs before Hopper), those the module launches there (POINTER_TILES)."""
    if not tma and kernel.tiles in module.POINTER_TILES:
        return dict(zip(TILE_KEYS, module.POINTER_TILES[kernel.tiles], strict=True))
    return {key: getattr(module, f"{kernel.tiles}{key}".upper()) for key in TILE_KEYS}


def _signature(module, kernel: Kernel, dtype: str, tma: bool = True):
    """Argument types as a launch on contiguous tensors would specialise them, read off the kernel's
    declaration by argument name (so no argument order is repeated here). tma: whether the target
    has tensor descriptors; without, a "desc" argument is what _descriptor passes there instead (the
    tensor, its batch, head and seq strides, seq and head_dim)."""
    fn = getattr(module, kernel.function)
    tiles = _tiles(module, kernel, tma)
    constexpr_values = {
        **dict(kernel.constexprs),
        "TMA": int(tma),
        "BLOCK_M": tiles["block_m"],
        "BLOCK_N": tiles["block_n"],
        # The Gluon kernels' tiles per consumer warpgroup: 64 rows, wgmma's for a warpgroup (queries of
        # the forward and the dQ kernel, keys of the dK/dV kernel).
        "WGMMA_ROWS": 64,
        "STAGES": tiles["num_stages"],
        "BLOCK_D": module.BLOCK_D,
        "BLOCK_DV": module.BLOCK_DV,
        "HEAD_DIM": module.HEAD_DIM,
        "HEAD_DIM_V": module.HEAD_DIM_V,
        # The Hopper forward's walk of its tiles, as the module launches it.
        "PERSISTENT": getattr(module, "SM90_PERSISTENT", 0),
        "DYNAMIC": getattr(module, "SM90_DYNAMIC", 0),
    }
    widths = {"d": module.BLOCK_D, "dv": module.BLOCK_DV, "d_half": module.BLOCK_D // 2, **constexpr_values}
    tensors = getattr(module, "TENSOR_PARAMS", {})
    signature, constexprs, attrs = {}, {}, {}
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        declared = kernel.argument(name)
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", constexpr_values[name]
        elif declared is not None and declared.kind == "desc" and not tma:
            signature[name] = (f"*{_ELEMENT[dtype]}", "i32", "i32", "i32", "i32", "i32")
            head_dim = module.HEAD_DIM if declared.width == "d" else module.HEAD_DIM_V
            # The data, its strides (multiples of head_dim) and head_dim are multiples of 16 when
            # head_dim is; seq is anything.
            for part in (0, 1, 2, 3, 5) if head_dim % 16 == 0 else (0,):
                attrs[(index, part)] = [["tt.divisibility", 16]]
            continue
        elif declared is not None and declared.kind == "desc":
            rows = constexpr_values[declared.rows]
            signature[name] = f"tensordesc<{_ELEMENT[dtype]}[1,1,{rows},{widths[declared.width]}]>"
        elif declared is not None and declared.kind == "nvmma_desc":
            element = declared.element or dtype
            signature[name] = _nvmma_descriptor_type(element, constexpr_values[declared.rows], widths[declared.width])
        elif declared is not None and declared.kind == "none":  # a launch passes None: a constexpr
            signature[name], constexprs[name] = "constexpr", None
        elif declared is not None:
            signature[name] = f"*{_ELEMENT[dtype]}" if declared.kind == "*in" else declared.kind
        # What the spec adds after the declared arguments: block tables, its params, trained reads' outputs.
        elif name == "TABLES":  # block tables of a mask that reads tensors (_block_tables)
            signature[name], declared = "*i32", Arg("*i32", divisible=True)
        elif name.startswith("tables_stride_"):
            signature[name] = "i32"
        elif name.startswith("PARAM_GRAD"):  # where the dQ kernel writes a trained read's gradient share
            signature[name], declared = ("*i64" if name.endswith("_INDEX") else "*fp32"), Arg("*fp32", divisible=True)
        elif name.removeprefix("param_") in tensors:  # a tensor param's data
            signature[name] = {float: "*fp32", int: "*i32", bool: "*i1"}[tensors[name.removeprefix("param_")][0]]
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


def _nvmma_descriptor_type(dtype: str, rows: int, width: int) -> str:
    """A Gluon descriptor's type, as a launch mangles it: the shared-memory layout is part of it."""
    from triton.experimental.gluon import language as gl

    block = [1, 1, rows, width]
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, _GLUON_ELEMENT[dtype]))
    return f"tensordesc<{_ELEMENT[dtype]}{block},{layout!r}>"


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack frame (bytes; > 0 means spills) of the cubin Triton built, and where it
    spills: its spill instructions by loop depth (attngen.check.sass), "a/b/c" from outside any loop
    to the innermost."""
    from triton.backends import nvidia

    cuobjdump = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)

        def dump(flag: str) -> str:
            return subprocess.run([cuobjdump, flag, str(path)], capture_output=True, text=True, check=True).stdout

        usage = re.search(r"REG:(\d+) STACK:(\d+)", dump("--dump-resource-usage"))
        if not usage:
            return {}
        resources = {"registers": int(usage.group(1)), "stack_bytes": int(usage.group(2))}
        if resources["stack_bytes"]:
            depths = sass.spills_by_loop_depth(dump("--dump-sass"))
            resources["spills_by_loop_depth"] = "/".join(map(str, depths))
    return resources


# The AMD kernel's code-object metadata (amdhsa.kernels in the amdgcn text) and how findings name it.
# VGPRs spill to scratch, per-lane memory behind the vector L1 (its size per lane is the cost, as
# NVIDIA's stack frame is); SGPRs spill to lanes of a VGPR, which costs little.
_AMDGCN_USAGE = {
    "vgpr_count": "vgprs",  # with the AGPRs: CDNA's unified register file, up to 512 per lane
    "agpr_count": "agprs",  # the accumulation registers of CDNA's matrix cores
    "sgpr_count": "sgprs",
    "vgpr_spill_count": "vgpr_spills",
    "sgpr_spill_count": "sgpr_spills",
    "private_segment_fixed_size": "scratch_bytes",
}


def _amdgcn_usage(amdgcn: str) -> dict:
    """Registers, spills and scratch bytes per lane of the one kernel of Triton's amdgcn text."""
    metadata = dict(re.findall(r"^\s*-?\s*\.(\w+):\s+(\d+)$", amdgcn, re.MULTILINE))
    return {label: int(metadata[key]) for key, label in _AMDGCN_USAGE.items() if key in metadata}


def _descriptor_note(kernel: Kernel, compiled, target: GpuTarget) -> str:
    """How the kernel moves its tiles where there is no TMA: on sm80 through pointers (the module's
    _descriptor passes the tensor and its strides), on AMD through descriptors that Triton lowers to
    loads. With TMA Triton records each descriptor's layout in tensordesc_meta."""
    if not any(arg.kind == "desc" for _, arg in kernel.arguments) or compiled.metadata.tensordesc_meta:
        return ""
    if target.backend == "cuda":
        return f"no TMA on {target.name}: tiles move through pointers"
    return f"no TMA on {target.name}: Triton lowers the tensor descriptors to loads"


def _not_built_note(module, kernel: Kernel, target: GpuTarget) -> str:
    """Why a kernel for some GPUs only (a Hopper Gluon kernel) is not built for `target`, and which
    kernels serve that launch there: the Triton kernels whose function its own extends
    (_attention_fwd_sm90 stands in for _attention_fwd)."""
    instead = [
        k.name
        for k in TRITON_GPU.kernels
        if not k.capabilities
        and k.family == kernel.family
        and kernel.function.startswith(k.function)
        and (k.enabled_by is None or getattr(module, k.enabled_by.upper()))
    ]
    archs = ", ".join(f"sm{capability}" for capability in kernel.capabilities)
    what = kernel.about.split(":")[0]  # e.g. "Forward on Hopper (Gluon)"
    if not instead and kernel.family != "training":  # attention_fp8: nothing else runs it
        return f"not built for {target.name}: {what} runs on {archs} only, and nothing else serves it"
    serve = f"{' and '.join(instead)} (Triton) serve{'s' if len(instead) == 1 else ''}" if instead else "Triton serves"
    return f"not built for {target.name}: {what} runs on {archs} only; {serve} this GPU"


def compile_kernel(module, kernel: Kernel, dtype: str, target: GpuTarget | int, *, num_stages=None, **constexprs):
    """One kernel of a generated triton_gpu module, compiled for `target` (an int: a CUDA compute
    capability). num_stages and constexprs (e.g. PAGE_SIZE=16) compile another of the kernel's
    launches than the one its declaration describes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    if isinstance(target, int):
        target = GpuTarget(f"sm{target}", "cuda", target, 32, max_shared=0)
    tma = _has_tma(target)
    tiles = _tiles(module, kernel, tma)
    fn, signature, declared, attrs = _signature(module, kernel, dtype, tma)
    constexprs = {**declared, **constexprs}
    if kernel.language == "gluon":  # warp-specialized: registers move between partitions
        source = GluonASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
        # The forward's consumer warpgroups hold 64 of its queries each; the backward's are two.
        consumers = tiles["block_m"] // 64 if kernel.function == "_attention_fwd_sm90" else 2
        options = {"num_warps": tiles["num_warps"], "maxnreg": module.SM90_MAX_REGISTERS[consumers]}
    else:
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        # A module may launch with fewer stages on AMD GPUs (DECODE_NUM_STAGES_HIP): compile what runs.
        stages = num_stages or tiles["num_stages"]
        if target.backend == "hip":
            stages = getattr(module, f"{kernel.tiles}num_stages_hip".upper(), stages)
        options = {"num_warps": tiles["num_warps"], "num_stages": stages}
    return triton.compile(source, target=GPUTarget(target.backend, target.arch, target.warp_size), options=options)


def check_gpu(module, dtype: str, target: GpuTarget) -> Iterator[Finding]:
    """Compile each kernel of a generated triton_gpu module for `target`, a finding as each is done."""
    for kernel in TRITON_GPU.kernels:
        if kernel.enabled_by and not getattr(module, kernel.enabled_by.upper()):  # e.g. no short forward
            continue
        name = kernel.name
        if kernel.capabilities and target.capability not in kernel.capabilities:  # a Hopper kernel elsewhere
            yield Finding(target.name, name, "", ok=True, skipped=True, note=_not_built_note(module, kernel, target))
            continue
        blocks = " ".join(f"{key}={value}" for key, value in _tiles(module, kernel, _has_tma(target)).items())
        try:
            compiled = compile_kernel(module, kernel, dtype, target)
        except Exception as e:  # noqa: BLE001  (any compiler failure is the finding)
            message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            yield Finding(target.name, name, blocks, ok=False, problem=f"does not compile: {message}")
            continue
        shared = compiled.metadata.shared
        if target.backend == "cuda":
            resources = {"shared": f"{shared / 1024:.0f} KiB", **_resource_usage(compiled.asm["cubin"])}
            spills = resources.get("stack_bytes", 0)
            warning = f"registers spill to a {spills}-byte stack frame" if spills else ""
        else:
            resources = {"lds": f"{shared / 1024:.0f} KiB", **_amdgcn_usage(compiled.asm["amdgcn"])}
            spills = resources.get("scratch_bytes", 0)
            warning = (
                f"{resources.get('vgpr_spills', 0)} VGPRs spill to a {spills}-byte scratch frame" if spills else ""
            )
        if shared > target.max_shared:
            problem = (
                f"{target.memory} {shared / 1024:.0f} KiB > {target.max_shared / 1024:.0f} KiB per block"
                f" (smaller blocks or fewer {kernel.tiles}num_stages)"
            )
            yield Finding(target.name, name, blocks, ok=False, problem=problem, resources=resources)
            continue
        note = _descriptor_note(kernel, compiled, target)
        yield Finding(target.name, name, blocks, ok=True, warning=warning, resources=resources, note=note)


def main(argv: list[str]) -> None:
    path, dtype, *targets = argv
    module = import_generated(Path(path), "_attngen_check_triton_gpu")
    for name in targets:
        for finding in check_gpu(module, dtype, GPU_TARGETS[name]):
            print(json.dumps(dataclasses.asdict(finding)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
