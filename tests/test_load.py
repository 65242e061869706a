"""attngen.load: a generated module built into a per-user cache and imported, from anywhere."""

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import attngen
from attngen.backends import TARGETS
from attngen.build import default_cache_dir, target_source
from attngen.errors import BuildError

# A small fp32 spec, so that the interpreters are exact and quick.
SPEC = """\
name = "tiny_causal"
head_dim = 16
dtype = "float32"

[mask]
causal = true

[triton]
block_m = 16
block_n = 16

[pallas_tpu]
block_q = 16
block_kv = 128
"""

# Run from a folder outside the repository: nothing but the installed attngen is importable.
SCRIPT = """\
import sys

import numpy as np

import attngen
from attngen.reference import attention_ref

spec_file, target = sys.argv[1:]
module = attngen.load(spec_file, target=target)
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, 50, 16)).astype(np.float32) for _ in range(3))
if target == "triton_gpu":
    import torch

    out = module.attention(*map(torch.from_numpy, (q, k, v))).numpy()
else:
    import jax.numpy as jnp

    out = np.asarray(module.attention(*map(jnp.asarray, (q, k, v)), interpret=True))
ref, _ = attention_ref(attngen.load_spec(spec_file), q, k, v)
print(module.__file__)
print(float(np.max(np.abs(out - ref))))
"""


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_a_script_outside_the_repo_loads_exact_kernels(tmp_path, target):
    (tmp_path / "tiny.toml").write_text(SPEC)
    (tmp_path / "use.py").write_text(SCRIPT)
    cache = tmp_path / "cache"
    env = {**os.environ, "ATTNGEN_CACHE_DIR": str(cache), "TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "use.py", "tiny.toml", target],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    path, error = result.stdout.split()
    assert Path(path).parent.parent == cache  # built under ATTNGEN_CACHE_DIR
    assert float(error) <= 2e-5  # attngen.exactness's fp32 bound


def test_the_cache_is_keyed_by_the_rendered_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # headers name the spec relative to here: the same source every run
    (tmp_path / "tiny.toml").write_text(SPEC)
    spec = attngen.load_spec("tiny.toml")
    module = attngen.load(spec, "pallas_tpu", cache_dir=tmp_path / "cache")
    assert attngen.load("tiny.toml", "pallas_tpu", cache_dir=tmp_path / "cache") is module  # imported once
    source = target_source(spec, TARGETS[1])
    assert Path(module.__file__).read_text() == source
    assert Path(module.__file__).parent.name == f"tiny_causal-{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    # Other tiles, same spec hash: another source, another entry and module.
    other = attngen.load(
        attngen.parse_spec(SPEC.replace("block_q = 16", "block_q = 32"), "tiny.toml"),
        "pallas_tpu",
        cache_dir=tmp_path / "cache",
    )
    assert other is not module and other.BLOCK_Q == 32 and len(list((tmp_path / "cache").iterdir())) == 2


def test_a_changed_cache_entry_is_refused_not_overwritten(tmp_path):
    # A spec of its own: a module this process imported already would be handed back at once.
    spec = attngen.parse_spec(SPEC.replace("tiny_causal", "tiny_edited"), "tiny.toml")
    source = target_source(spec, TARGETS[1])
    entry = tmp_path / f"tiny_edited-{hashlib.sha256(source.encode()).hexdigest()[:16]}" / "pallas_tpu.py"
    entry.parent.mkdir()
    entry.write_text("print('edited by hand')\n")
    with pytest.raises(BuildError, match="does not hold the source its name says"):
        attngen.load(spec, "pallas_tpu", cache_dir=tmp_path)
    assert entry.read_text() == "print('edited by hand')\n"


def test_the_default_cache_and_its_override(monkeypatch, tmp_path):
    monkeypatch.delenv("ATTNGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "attngen"
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"


def test_an_unknown_target_is_named(tmp_path):
    with pytest.raises(BuildError, match="unknown target 'cuda'; choose from triton_gpu, pallas_tpu"):
        attngen.load(attngen.parse_spec(SPEC, "tiny.toml"), "cuda", cache_dir=tmp_path)


def test_built_output_is_an_importable_package(tmp_path):
    """`attngen build --out mypkg/`: mypkg is a regular package (an __init__.py), importable from
    wherever its parent is on sys.path."""
    from attngen.cli import main

    spec_file = Path(__file__).resolve().parent.parent / "specs" / "causal.toml"
    assert main(["build", str(spec_file), "--out", str(tmp_path / "mypkg"), "--allow-outside"]) == 0
    check = textwrap.dedent("""\
        import importlib.util
        import mypkg, mypkg.causal
        assert mypkg.__file__ and mypkg.causal.__file__  # regular packages, not namespace ones
        assert importlib.util.find_spec("mypkg.causal.triton_gpu") and importlib.util.find_spec("mypkg.causal.pallas_tpu")
    """)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_a_users_package_init_and_a_project_root_are_left_alone(tmp_path):
    from attngen.build import write_root_init

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("VERSION = 1\n")
    assert write_root_init(tmp_path / "pkg") is None
    assert (tmp_path / "pkg" / "__init__.py").read_text() == "VERSION = 1\n"
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "pyproject.toml").write_text("")
    assert write_root_init(tmp_path / "project") is None
    assert not (tmp_path / "project" / "__init__.py").exists()
    assert write_root_init(tmp_path / "fresh").changed
    assert not write_root_init(tmp_path / "fresh").changed  # written once, then up to date
