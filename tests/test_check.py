"""attngen check: ahead-of-time compiles for NVIDIA and AMD GPUs (Triton) and TPU v5e/v5p/v6e (Mosaic)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings

import attngen.check
from attngen.backends.triton_gpu import TRITON_GPU
from attngen.check import (
    DEFAULT_TARGET_NAMES,
    GPU_TARGET_NAMES,
    TPU_TARGET_NAMES,
    Finding,
    check_spec,
    iter_check,
)
from attngen.check.gpu import GPU_TARGETS, _amdgcn_usage
from attngen.cli import main
from attngen.spec import load_spec, parse_spec, with_config
from tests import harness
from tests.strategies import specs
from tests.test_triton import SPECS

# A spec's GPU and TPU compiles are two tests (10-20 s each on a CPU): xdist runs them side by side.
# The default targets only: Blackwell and AMD Instinct (opt-in) are checked on one spec below.
TARGET_GROUPS = {
    "gpu": tuple(t for t in DEFAULT_TARGET_NAMES if t in GPU_TARGET_NAMES),
    "tpu": tuple(t for t in DEFAULT_TARGET_NAMES if t in TPU_TARGET_NAMES),
}
# Every spec compiles for the first GPU and TPU targets (sm90's Triton kernels but the short-sequence
# forward, tpu-v5e). The other targets compile the same templates for every spec, and so do the
# Hopper kernels (Gluon: the forward, its FP8 form, dQ, dK/dV) and the short-sequence forward (the
# forward's template at smaller tiles): within CI's time, this spread keeps them checked (closed-form
# bounds, block tables, a score reading a tensor param at each position, head dims 192 / 128).
# tests/test_gpu.py runs the Hopper kernels of every spec on an H200.
SPREAD_SPECS = {"causal", "document", "bias", "value_dim"}
EVERY_SPEC_TARGETS = ("sm90", "tpu-v5e")


@pytest.mark.parametrize("group", sorted(TARGET_GROUPS))
@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_specs_compile_for_every_target(spec_file, group):
    assert {*TARGET_GROUPS["gpu"], *TARGET_GROUPS["tpu"]} == set(DEFAULT_TARGET_NAMES)  # the groups cover them
    spec = load_spec(spec_file)
    targets = TARGET_GROUPS[group]
    if spec.name not in SPREAD_SPECS:
        targets = tuple(t for t in targets if t in EVERY_SPEC_TARGETS)
        if group == "gpu":
            spec = with_config(
                spec,
                "triton_gpu",
                sm90_forward=0,
                sm90_backward=0,
                sm90_dq=0,
                sm90_fp8=0,
                sm90_fused_backward=0,
                short_kv_len=0,
            )
    elif group == "gpu":  # (also where a spec's defaults leave them out)
        spec = with_config(spec, "triton_gpu", sm90_forward=1, sm90_backward=1, sm90_dq=1, sm90_fp8=1)
    findings = check_spec(spec, targets)
    assert {f.target for f in findings} == set(targets)
    if group == "gpu":
        config = spec.config("triton_gpu")
        kernels = {k.name for k in TRITON_GPU.kernels if k.enabled_by is None or getattr(config, k.enabled_by)}
    else:
        kernels = {"fwd", "bwd", "decode", "decode_paged"}
    assert {f.kernel for f in findings} == kernels  # every declared kernel
    failures = [f.line() for f in findings if not f.ok]
    assert not failures, failures
    # GPUs without TMA launch their own tiles (POINTER_TILES), chosen to spill nowhere on sm80.
    spills = [f.line() for f in findings if f.target == "sm80" and f.warning]
    assert not spills, spills
    # Where an NVIDIA kernel spills, the check says at which loop depth its spill instructions sit.
    nvidia = [f for f in findings if f.target.startswith("sm") and f.resources.get("stack_bytes")]
    assert all("spills_by_loop_depth" in f.resources for f in nvidia), [f.line() for f in nvidia]
    tpu = [f for f in findings if f.target.startswith("tpu")]
    assert all("lowered to Mosaic only" not in f.warning for f in tpu), "libtpu missing: no real Mosaic compile"


@settings(max_examples=1)
@given(drawn=specs(dtypes=("bfloat16", "float32"), head_dims=(64, 128)))
def test_drawn_specs_compile(drawn):
    # One GPU and one TPU: the drawn expressions are what varies here (specs/ covers every target).
    failures = [f.line() for f in check_spec(harness.spec_from_text(drawn.text), ("sm90", "tpu-v5e")) if not f.ok]
    assert not failures, failures


def test_blackwell_and_instinct_report_every_kernel_with_its_resources():
    """sm100 and gfx942 (opt-in targets): each declared kernel is compiled and its resources read
    from the binary, or said in one line not to be built there (the Hopper Gluon kernels). Without
    the short-sequence forward: the forward's template again, at smaller tiles."""
    spec = with_config(load_spec("specs/causal.toml"), "triton_gpu", short_kv_len=0)
    config = spec.config("triton_gpu")
    declared = [k for k in TRITON_GPU.kernels if k.enabled_by is None or getattr(config, k.enabled_by)]
    assert any(k.capabilities for k in declared)  # the stock spec has a Hopper-only kernel to skip
    findings = check_spec(spec, ("sm100", "gfx942"))
    assert not [f.line() for f in findings if not f.ok]
    for target in ("sm100", "gfx942"):
        by_kernel = {f.kernel: f for f in findings if f.target == target}
        assert set(by_kernel) == {k.name for k in declared}, target
        for kernel in declared:
            finding = by_kernel[kernel.name]
            if kernel.capabilities:  # e.g. fwd_sm90: the Triton kernels serve this GPU instead
                assert finding.skipped and not finding.resources
                assert finding.line().startswith(f"skip {target} {kernel.name}: not built for {target}:")
                # What serves the same entry point there; attention_fp8 has nothing else.
                assert ("(Triton) serve" if kernel.family == "training" else "nothing else serves it") in finding.note
                continue
            memory, registers, spill = (
                ("shared", "registers", "stack_bytes") if target == "sm100" else ("lds", "vgprs", "scratch_bytes")
            )
            assert finding.resources[memory].endswith(" KiB")
            assert finding.resources[registers] > 0 and spill in finding.resources, finding.line()
            takes_descriptors = any(arg.kind == "desc" for _, arg in kernel.arguments)
            # sm100 has TMA; AMD before gfx1250 has none: Triton rewrites descriptors into pointer loads.
            expected = "no TMA on gfx942" if target == "gfx942" and takes_descriptors else ""
            assert finding.note.startswith(expected) and bool(finding.note) == bool(expected), finding.line()


def test_new_gpu_targets_limits_and_explanations():
    """The per-block limits (CUDA programming guide, ROCm GPU specifications; gpu.py cites them),
    how AMD's registers and spills are read, and how their lines explain themselves."""
    kib = {name: target.max_shared // 1024 for name, target in GPU_TARGETS.items()}
    assert kib == {"sm90": 227, "sm80": 163, "sm100": 227, "sm120": 99, "gfx942": 64, "gfx950": 160}
    assert {GPU_TARGETS[name].memory for name in ("gfx942", "gfx950")} == {"LDS"}
    assert GPU_TARGETS["gfx942"].capability is None  # no CUDA capability: Hopper-only kernels skip it
    assert set(DEFAULT_TARGET_NAMES).isdisjoint({"sm100", "sm120", "gfx942", "gfx950"})  # opt-in

    # The code-object metadata of a gfx942 forward, as Triton 3.6 writes it in the amdgcn text.
    amdgcn = (
        "  - .agpr_count:     0\n    .args:\n    .private_segment_fixed_size: 1096\n    .sgpr_count:     106\n"
        "    .sgpr_spill_count: 214\n    .vgpr_count:     256\n    .vgpr_spill_count: 274\n"
        "\t\t.amdhsa_private_segment_fixed_size 1096\n"
    )
    usage = _amdgcn_usage(amdgcn)
    assert usage == {
        "vgprs": 256,
        "agprs": 0,
        "sgprs": 106,
        "vgpr_spills": 274,
        "sgpr_spills": 214,
        "scratch_bytes": 1096,
    }
    warn = Finding(
        "gfx942",
        "fwd",
        "block_m=128 block_n=128",
        ok=True,
        warning="274 VGPRs spill to a 1096-byte scratch frame",
        resources={"lds": "32 KiB", **usage},
        note="no TMA on gfx942: Triton lowers the tensor descriptors to loads",
    ).line()
    assert warn.startswith("WARN gfx942 fwd (block_m=128 block_n=128): 274 VGPRs spill to a 1096-byte scratch")
    assert "can make the kernel several times slower" in warn and "measured on an H200 (sm90), not this GPU" in warn
    assert warn.endswith("scratch_bytes 1096]; no TMA on gfx942: Triton lowers the tensor descriptors to loads")
    skip = Finding("sm120", "fwd_sm90", "", ok=True, skipped=True, note="not built for sm120: ...").line()
    assert skip == "skip sm120 fwd_sm90: not built for sm120: ..."


def test_too_much_shared_memory_is_one_clear_line(capsys, tmp_path):
    text = Path(load_spec("specs/full.toml").path).read_text()
    spec_file = tmp_path / "wide.toml"
    # (The Hopper kernels left out: their compiles would only slow this test.)
    tiles = "block_m = 128\nblock_n = 128\nnum_warps = 8\nnum_stages = 4\nsm90_forward = 0\nsm90_backward = 0\nsm90_fp8 = 0\n"
    spec_file.write_text(text + "[triton]\n" + tiles)
    assert main(["check", str(spec_file), "--target", "sm90"]) == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if "FAIL" in line]
    assert (
        lines[0].strip().startswith("FAIL sm90 fwd (block_m=128 block_n=128 num_warps=8 num_stages=4): shared memory")
    )
    assert "> 227 KiB per block" in lines[0]


def test_scoped_vmem_overflow_is_one_clear_line():
    """Validation estimates VMEM and refuses the spec; past it, Mosaic's own OOM is reported."""
    with pytest.raises(Exception, match=r"needs about 43.0 MiB of VMEM .* the scoped limit is 16 MiB"):
        parse_spec('name = "big"\nhead_dim = 128\n[pallas_tpu]\nblock_q = 2048\nblock_kv = 4096\n', "big.toml")
    spec = load_spec("specs/causal.toml")
    spec = with_config(spec, "pallas_tpu", block_q=2048, block_kv=4096)
    fwd = next(iter_check(spec, ("tpu-v5e",)))  # the forward's finding comes first: the rest is not compiled
    assert not fwd.ok and fwd.line().startswith("FAIL tpu-v5e fwd (block_q=2048 block_kv=4096): scoped VMEM")
    assert "limit 16.00MB" in fwd.problem and "estimate 43.0 MiB" in fwd.problem


def test_tpu_block_rule_is_one_clear_line():
    with pytest.raises(Exception, match=r"block_kv must be a multiple of 128"):
        parse_spec('name = "odd"\nhead_dim = 128\n[pallas_tpu]\nblock_kv = 100\n', "odd.toml")


def test_check_prints_each_finding_as_it_is_found(monkeypatch, capsys):
    printed_before = []  # what the CLI had printed when each kernel's compile began

    def one_by_one(spec, targets):
        for kernel in ("fwd", "bwd"):
            printed_before.append(capsys.readouterr().out)
            yield Finding("tpu-v5e", kernel, "block_q=16 block_kv=128", ok=True, resources={"vmem_limit": "16 MiB"})

    monkeypatch.setattr(attngen.check, "iter_check", one_by_one)
    assert main(["check", "specs/causal.toml", "--target", "tpu-v5e"]) == 0
    assert "specs/causal.toml: checking tpu-v5e" in printed_before[0]
    assert printed_before[1].strip() == "ok   tpu-v5e fwd (block_q=16 block_kv=128): vmem_limit 16 MiB"


def test_check_spec_is_iter_check_collected():
    spec = load_spec("specs/causal.toml")
    findings = iter_check(spec, ("tpu-v5e",))
    first = next(findings)  # the forward's finding, before the backward is compiled
    assert (first.target, first.kernel) == ("tpu-v5e", "fwd")
    assert next(findings).kernel == "bwd"  # (the decode kernels' compiles are left out: findings closes)
    findings.close()


def test_a_failing_gpu_check_process_reports_its_stderr(tmp_path):
    from attngen.check import gpu

    with pytest.raises(RuntimeError, match=r"(?s)the GPU check of .*missing\.py failed:.*missing\.py"):
        list(gpu.check_gpu_isolated(tmp_path / "missing.py", "float32", ["sm90"]))


@pytest.mark.parametrize(
    "target, stack_bytes, says",
    [
        ("sm90", 152, "how much it matters: little; 152 B per thread"),
        ("sm90", 1584, "can make the kernel several times slower"),
        ("sm80", 5016, "tiles from the tuned table were measured on an H200 (sm90), not this GPU"),
    ],
)
def test_a_spill_warning_says_what_it_costs(target, stack_bytes, says):
    finding = Finding(
        target,
        "bwd_dkdv",
        "block_m=64 block_n=128",
        ok=True,
        warning=f"registers spill to a {stack_bytes}-byte stack frame",
        resources={"registers": 255, "stack_bytes": stack_bytes},
    )
    line = finding.line()
    assert line.startswith(f"WARN {target} bwd_dkdv (block_m=64 block_n=128): registers spill") and says in line
    assert "\n" not in line and line.endswith(f"[registers 255, stack_bytes {stack_bytes}]")


def test_check_on_a_cpu_machine_prints_no_libtpu_start_up_notice():
    """libtpu logs E0000 ... INVALID_ARGUMENT when it starts on a machine with no TPU: noise here."""
    result = subprocess.run(
        [sys.executable, "-m", "attngen.cli", "check", "specs/causal.toml", "--target", "tpu-v5e"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok   tpu-v5e bwd" in result.stdout
    for noise in ("E0000", "INVALID_ARGUMENT", "could not determine TPU", "InitGoogle", "Source Location Trace"):
        assert noise not in result.stderr, result.stderr


def test_only_the_libtpu_notice_is_held_back(capfd):
    from attngen.check.tpu import _libtpu_notice_held_back

    notice = (
        b"Failed to find host bounds for accelerator type: WARNING: could not determine TPU accelerator type\n"
        b"WARNING: Logging before InitGoogle() is written to STDERR\n"
        b"E0000 00:00:1.2 1 common_lib.cc:554] INVALID_ARGUMENT: Error: unexpected worker hostname 'WARNING:"
        b" could not determine TPU worker hostnames or IP addresses' from env var TPU_WORKER_HOSTNAMES.\n"
        b"=== Source Location Trace: ===\nlearning/45eac/tfrc/runtime/libtpu_init_utils.cc:327\n"
    )
    with _libtpu_notice_held_back():
        os.write(2, b"E0001 a real error\n" + notice + b"another real line\n")
    assert capfd.readouterr().err == "E0001 a real error\nanother real line\n"


# A kernel's SASS as cuobjdump prints it (the encodings left out): a loop with an out-of-line path
# that returns into it from after the kernel's end, and, reached only through BRX, a partition of two
# nested loops; then the spin after the last EXIT.
_SASS = """
        /*0000*/              @P3 BRX R2 -0x10 ;
        /*0010*/                  STL [R1], R2 ;
        /*0020*/                  ISETP.GE.AND P0, PT, R3, R4, PT ;
        /*0030*/              @P0 BRA 0x90 ;
        /*0040*/                  LDL R5, [R1] ;
        /*0050*/                  IADD3 R3, R3, 0x1, RZ ;
        /*0060*/             @!P1 BRA 0x20 ;
        /*0070*/                  STL [R1+0x4], R6 ;
        /*0080*/                  EXIT ;
        /*0090*/                  STL [R1+0x8], R7 ;
        /*00a0*/                  BRA 0x40 ;
        /*00b0*/                  STL [R1+0xc], R8 ;
        /*00c0*/                  MOV R9, R10 ;
        /*00d0*/                  LDL R11, [R1+0xc] ;
        /*00e0*/              @P2 BRA 0xd0 ;
        /*00f0*/              @P4 BRA 0xc0 ;
        /*0100*/                  EXIT ;
        /*0110*/                  BRA 0x110 ;
"""


def test_spills_are_counted_by_the_loops_that_hold_them():
    """Loops are found by dominators, not by branches to lower addresses: the out-of-line path's STL
    is in the loop it returns to, and the STL after that loop (below the path's branch back) is not."""
    from attngen.check.sass import spills_by_loop_depth

    assert spills_by_loop_depth(_SASS) == (3, 2, 1)  # 0x10, 0x70, 0xb0; 0x40, 0x90; 0xd0
    assert spills_by_loop_depth("") == (0,)


@pytest.mark.parametrize(
    "by_depth, says",
    [
        ("7", "little; its spill instructions are all outside the kernel's loops"),
        ("50/48/37", "37 of its spill instructions sit 2 loops deep (by depth: 50/48/37); 128 B per thread"),
    ],
)
def test_a_spill_warning_says_where_the_spills_sit(by_depth, says):
    resources = {"registers": 168, "stack_bytes": 128, "spills_by_loop_depth": by_depth}
    finding = Finding("sm90", "fwd_sm90", "", ok=True, warning="registers spill", resources=resources)
    assert says in finding.line()
