"""Building packages: determinism, headers, committed output, safety of writes, the CLI."""

import subprocess
import sys
from pathlib import Path

import pytest

from attngen.build import package_sources, write_package
from attngen.cli import main
from attngen.errors import BuildError
from attngen.plan import HEADER_NOTE
from attngen.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.toml"))


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # headers name spec files relative to the working directory


@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_committed_package_is_current(spec_file):
    """generated/ holds exactly what the current compiler emits (golden snapshot)."""
    spec = load_spec(spec_file.relative_to(ROOT))
    committed = ROOT / "generated" / spec.name
    for name, source in package_sources(spec).items():
        assert (committed / name).read_text() == source, (
            f"generated/{spec.name}/{name} is stale: run attngen build specs/"
        )


def test_headers_name_the_spec_and_its_hash():
    spec = load_spec("specs/causal.toml")
    for source in package_sources(spec).values():
        first, second = source.splitlines()[:2]
        assert first == f"# {HEADER_NOTE}"
        assert second == f"# spec: causal (specs/causal.toml), sha256 {spec.sha256}"


def test_build_is_deterministic_and_writes_only_changes(tmp_path, capsys):
    assert main(["build", "specs/causal.toml", "--out", str(tmp_path)]) == 0
    first = {p.name: p.read_bytes() for p in (tmp_path / "causal").iterdir()}
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "causal").iterdir()}
    assert main(["build", "specs/causal.toml", "--out", str(tmp_path)]) == 0
    assert "up to date" in capsys.readouterr().out
    assert first == {p.name: p.read_bytes() for p in (tmp_path / "causal").iterdir()}
    assert mtimes == {p.name: p.stat().st_mtime_ns for p in (tmp_path / "causal").iterdir()}
    assert sorted(first) == ["__init__.py", "pallas_tpu.py", "triton_gpu.py"]


def test_never_overwrites_a_file_it_did_not_write(tmp_path):
    (tmp_path / "causal").mkdir()
    mine = tmp_path / "causal" / "triton_gpu.py"
    mine.write_text("# my own kernel\n")
    with pytest.raises(BuildError, match="not written by attngen"):
        write_package(load_spec("specs/causal.toml"), tmp_path)
    assert mine.read_text() == "# my own kernel\n"


def test_cli_reports_spec_errors_without_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nhead_dim = 64\n[mask]\nexpr = "q_idx >= nope"\n')
    assert main(["build", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4:18: error: unknown name `nope`" in err and "Traceback" not in err
    assert main(["build", str(tmp_path / "missing.toml")]) == 2
    assert "no such spec file" in capsys.readouterr().err


def test_cli_builds_a_folder(tmp_path, capsys):
    assert main(["build", "specs", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.stem for p in SPECS)
    assert f"[{len(SPECS)}/{len(SPECS)}]" in capsys.readouterr().out


@pytest.mark.parametrize("target, forbidden", [("triton_gpu", "jax"), ("pallas_tpu", "torch")])
def test_importing_one_target_does_not_import_the_other(target, forbidden):
    code = f"import sys, generated.causal.{target}; assert {forbidden!r} not in sys.modules, 'imported {forbidden}'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
