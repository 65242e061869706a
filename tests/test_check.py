"""attngen check: ahead-of-time compiles for sm90/sm80 (Triton) and TPU v5e/v5p/v6e (Mosaic)."""

from pathlib import Path

import pytest
from hypothesis import given, settings

from attngen.backends.triton_gpu import TRITON_GPU
from attngen.check import GPU_TARGET_NAMES, TARGET_NAMES, TPU_TARGET_NAMES, check_spec
from attngen.cli import main
from attngen.spec import load_spec, parse_spec, with_config
from tests import harness
from tests.strategies import specs
from tests.test_triton import SPECS

# A spec's GPU and TPU compiles are two tests (10-20 s each on a CPU): xdist runs them side by side.
TARGET_GROUPS = {"gpu": GPU_TARGET_NAMES, "tpu": TPU_TARGET_NAMES}


@pytest.mark.parametrize("group", sorted(TARGET_GROUPS))
@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_specs_compile_for_every_target(spec_file, group):
    assert {*GPU_TARGET_NAMES, *TPU_TARGET_NAMES} == set(TARGET_NAMES)  # the groups cover every target
    spec = load_spec(spec_file)
    findings = check_spec(spec, TARGET_GROUPS[group])
    assert {f.target for f in findings} == set(TARGET_GROUPS[group])
    if group == "gpu":
        config = spec.config("triton_gpu")
        kernels = {k.name for k in TRITON_GPU.kernels if k.enabled_by is None or getattr(config, k.enabled_by)}
    else:
        kernels = {"fwd", "bwd"}
    assert {f.kernel for f in findings} == kernels  # every declared kernel
    failures = [f.line() for f in findings if not f.ok]
    assert not failures, failures
    tpu = [f for f in findings if f.target.startswith("tpu")]
    assert all("lowered to Mosaic only" not in f.warning for f in tpu), "libtpu missing: no real Mosaic compile"


@settings(max_examples=3)
@given(drawn=specs(dtypes=("bfloat16", "float32"), head_dims=(64, 128)))
def test_drawn_specs_compile(drawn):
    failures = [f.line() for f in check_spec(harness.spec_from_text(drawn.text)) if not f.ok]
    assert not failures, failures


def test_too_much_shared_memory_is_one_clear_line(capsys, tmp_path):
    text = Path(load_spec("specs/full.toml").path).read_text()
    spec_file = tmp_path / "wide.toml"
    spec_file.write_text(text + "[triton]\nblock_m = 128\nblock_n = 128\nnum_warps = 8\nnum_stages = 4\n")
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
    (fwd, _) = check_spec(spec, ("tpu-v5e",))
    assert not fwd.ok and fwd.line().startswith("FAIL tpu-v5e fwd (block_q=2048 block_kv=4096): scoped VMEM")
    assert "limit 16.00MB" in fwd.problem and "estimate 43.0 MiB" in fwd.problem


def test_tpu_block_rule_is_one_clear_line():
    with pytest.raises(Exception, match=r"block_kv must be a multiple of 128"):
        parse_spec('name = "odd"\nhead_dim = 128\n[pallas_tpu]\nblock_kv = 100\n', "odd.toml")
