"""Building packages: determinism, headers, committed output, safety of writes, the CLI."""

import dataclasses
import os
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import attngen.build
import attngen.cli
from attngen.build import package_sources, write_package
from attngen.cli import EXIT_INTERNAL_ERROR, main, project_root
from attngen.errors import BuildError
from attngen.plan import HEADER_NOTE
from attngen.spec import load_spec, with_config

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
    assert main(["build", "specs/causal.toml", "--out", str(tmp_path), "--allow-outside"]) == 0
    first = {p.name: p.read_bytes() for p in (tmp_path / "causal").iterdir()}
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "causal").iterdir()}
    assert main(["build", "specs/causal.toml", "--out", str(tmp_path), "--allow-outside"]) == 0
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
    assert main(["build", str(bad), "--out", str(tmp_path), "--allow-outside"]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:4:18: error: unknown name `nope`" in err and "Traceback" not in err
    assert main(["build", str(tmp_path / "missing.toml")]) == 2
    assert "no such spec file" in capsys.readouterr().err


def test_cli_builds_a_folder(tmp_path, capsys):
    assert main(["build", "specs", "--out", str(tmp_path), "--allow-outside"]) == 0
    # A package per spec, and the folder's __init__.py (it is a package too: tests/test_load.py).
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["__init__.py", *(p.stem for p in SPECS)])
    assert f"[{len(SPECS)}/{len(SPECS)}]" in capsys.readouterr().out


@pytest.mark.parametrize("target, forbidden", [("triton_gpu", "jax"), ("pallas_tpu", "torch")])
def test_importing_one_target_does_not_import_the_other(target, forbidden):
    code = f"import sys, generated.causal.{target}; assert {forbidden!r} not in sys.modules, 'imported {forbidden}'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# ----------------------------------------------------------------------------- writes that cannot lose a file


def test_concurrent_writers_never_show_a_partial_file(tmp_path, monkeypatch):
    """Threads write two versions of one package at once while a reader watches: every read is
    a whole file of one version, and so is every file at the end, with no temporary files left."""
    spec_a = load_spec("specs/causal.toml")
    spec_b = dataclasses.replace(spec_a, sha256="b" * 64)  # same package, different bytes (the header)
    versions = {spec.sha256: package_sources(spec) for spec in (spec_a, spec_b)}
    monkeypatch.setattr(attngen.build, "package_sources", lambda spec: versions[spec.sha256])
    whole = {name: {v[name].encode() for v in versions.values()} for name in versions[spec_a.sha256]}
    stop = threading.Event()
    torn = []

    def read_forever():
        while not stop.is_set():
            for name, allowed in whole.items():
                try:
                    data = (tmp_path / "causal" / name).read_bytes()
                except FileNotFoundError:
                    continue
                if data not in allowed:
                    torn.append(name)

    reader = threading.Thread(target=read_forever)
    reader.start()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: write_package((spec_a, spec_b)[i % 2], tmp_path), range(200)))
    stop.set()
    reader.join()
    assert not torn
    final = {p.name: p.read_bytes() for p in (tmp_path / "causal").iterdir()}
    assert sorted(final) == sorted(whole) and all(final[name] in whole[name] for name in whole)


def test_concurrent_cli_builds_of_one_spec(tmp_path):
    """Several `attngen build` processes of the same spec into the same folder, started together."""
    command = [sys.executable, "-m", "attngen.cli", "build", "specs/causal.toml", "specs/full.toml"]
    command += ["--out", str(tmp_path), "--allow-outside"]
    runs = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    for run in runs:
        _, err = run.communicate(timeout=300)
        assert run.returncode == 0, err.decode()
    for name in ("causal", "full"):
        expected = package_sources(load_spec(f"specs/{name}.toml"))
        assert {p.name: p.read_text() for p in (tmp_path / name).iterdir()} == expected


def test_a_user_file_that_appears_during_the_build_is_kept(tmp_path, monkeypatch):
    """The check before writing is not enough: a new file is linked into place, which fails if
    the name was taken meanwhile, and then the build looks again."""
    staged = attngen.build._staged

    def user_writes_first(target, data):
        if target.name == "triton_gpu.py":
            target.write_text("# my kernel\n")
        return staged(target, data)

    monkeypatch.setattr(attngen.build, "_staged", user_writes_first)
    with pytest.raises(BuildError, match="not written by attngen"):
        write_package(load_spec("specs/causal.toml"), tmp_path)
    assert (tmp_path / "causal" / "triton_gpu.py").read_text() == "# my kernel\n"
    assert not [p for p in (tmp_path / "causal").iterdir() if p.name.endswith(".tmp")]


def test_an_impossible_out_folder_is_a_build_error(tmp_path):
    with pytest.raises(BuildError, match="embedded null byte"):
        write_package(load_spec("specs/causal.toml"), tmp_path / "nul\0")


@pytest.mark.parametrize("what", ["folder", "dangling link", "link to a user file", "file as package"])
def test_whatever_is_in_the_way_is_a_build_error(tmp_path, what):
    package = tmp_path / "causal"
    if what == "file as package":
        package.write_text("not a folder\n")
    else:
        package.mkdir()
        target = package / "pallas_tpu.py"
        if what == "folder":
            target.mkdir()
        elif what == "dangling link":
            target.symlink_to(tmp_path / "nowhere.py")
        else:
            (tmp_path / "mine.py").write_text("# mine\n")
            target.symlink_to(tmp_path / "mine.py")
    with pytest.raises(BuildError):
        write_package(load_spec("specs/causal.toml"), tmp_path)
    assert not (package.is_dir() and (package / "triton_gpu.py").exists())  # nothing half-written


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A project folder (pyproject.toml) holding one spec, as the working directory."""
    root = tmp_path / "project"
    (root / "sub").mkdir(parents=True)
    (root / "pyproject.toml").write_text("")
    shutil.copy(ROOT / "specs" / "causal.toml", root / "causal.toml")
    monkeypatch.chdir(root)
    return root


def test_out_outside_the_project_needs_allow_outside(project, capsys):
    outside = project.parent / "elsewhere"
    assert main(["build", "causal.toml", "--out", str(outside)]) == 2
    err = capsys.readouterr().err
    assert "is outside the project" in err and "--allow-outside" in err and "Traceback" not in err
    assert not outside.exists()
    assert main(["build", "causal.toml", "--out", "../elsewhere"]) == 2
    (project / "link").symlink_to(outside, target_is_directory=True)  # a link counts where it leads
    assert main(["build", "causal.toml", "--out", "link"]) == 2
    assert main(["build", "causal.toml", "--out", str(outside), "--allow-outside"]) == 0
    assert (outside / "causal" / "triton_gpu.py").exists()
    assert main(["build", "causal.toml", "--out", "generated"]) == 0
    assert (project / "generated" / "causal" / "triton_gpu.py").exists()


def test_project_root_is_the_nearest_marker(project, tmp_path):
    assert project_root(project / "sub") == project
    (project / "sub" / ".git").mkdir()
    assert project_root(project / "sub") == project / "sub"
    bare = tmp_path / "bare"
    bare.mkdir()
    assert project_root(bare) in (bare, *bare.parents)


def test_spec_in_a_subfolder_may_write_to_the_project_root(project, monkeypatch):
    monkeypatch.chdir(project / "sub")
    assert main(["build", "../causal.toml", "--out", "../generated"]) == 0


@pytest.mark.parametrize(
    "name, content",
    [
        (b"binary.toml", bytes(range(256))),
        (b"latin1.toml", 'name = "caf\xe9"\n'.encode("latin-1")),
        (b"sp\xffec.toml", b'name = "x"\nhead_dim = 64\n[mask]\nexpr = "q_idx >= nope"\n'),
        (b"esc\x1b[2J.toml", b'name = "x"\nhead_dim = 64\ncolour = "\\u001b[2J"\n'),
    ],
)
def test_cli_bad_specs_exit_2_without_traceback(project, capfdbinary, name, content):
    path = project / os.fsdecode(name)
    path.write_bytes(content)
    assert main(["build", str(path)]) == 2
    captured = capfdbinary.readouterr()
    assert b"Traceback" not in captured.err and b"\x1b" not in captured.err and b"\xff" not in captured.err


def test_cli_prints_undecodable_file_names_escaped(project, capsys):
    path = project / os.fsdecode(b"sp\xffec.toml")
    shutil.copy(project / "causal.toml", path)
    assert main(["build", str(path)]) == 0
    assert "sp\\xffec.toml -> generated/causal/" in capsys.readouterr().out


def test_cli_builds_the_good_specs_of_a_folder_with_a_bad_one(project, capsys):
    (project / "specs").mkdir()
    shutil.move(project / "causal.toml", project / "specs" / "causal.toml")
    (project / "specs" / "bad.toml").write_text('name = "bad"\n')
    assert main(["build", "specs"]) == 2
    assert (project / "generated" / "causal" / "triton_gpu.py").exists()
    assert "missing `head_dim`" in capsys.readouterr().err


def test_cli_internal_errors_are_reported_as_bugs(project, monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(attngen.cli, "build", broken)
    assert main(["build", "causal.toml"]) == EXIT_INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "internal error: RuntimeError: boom" in err and "Traceback" not in err
    assert main(["--debug", "build", "causal.toml"]) == EXIT_INTERNAL_ERROR
    assert "Traceback" in capsys.readouterr().err


def test_cli_check_of_an_invalid_spec_exits_2(project, capsys):
    (project / "bad.toml").write_text('name = "bad"\nhead_dim = 7\n')
    assert main(["check", "bad.toml", "--target", "sm90"]) == 2
    assert "bad.toml:2:1: error: head_dim 7 is outside 16..256" in capsys.readouterr().out


def test_cli_debug_shows_the_traceback_of_an_error(project, capsys):
    (project / "bad.toml").write_text("name = \n")
    assert main(["--debug", "build", "bad.toml"]) == 2
    assert main(["--debug", "build", "causal.toml", "--out", "/"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "outside the project" in err


def test_a_wheel_carries_what_attngen_build_reads(tmp_path):
    """Templates, the grammar and the tuned table are package data: a wheel installed anywhere
    builds a spec from a folder outside the repo (no file of the checkout is read)."""
    # Built from a copy of the sources: setuptools reuses an in-tree build/ folder, stale files too.
    source = tmp_path / "source"
    shutil.copytree(ROOT / "attngen", source / "attngen", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", wheels, source],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("attngen-*.whl")
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", site, wheel], check=True
    )
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "specs").mkdir(parents=True)
    shutil.copy(ROOT / "specs" / "causal.toml", elsewhere / "specs")
    # -I: isolated mode (no user site, no PYTHONPATH, no working directory on sys.path); the wheel
    # comes first on sys.path, ahead of the checkout's editable install.
    script = (
        f"import sys; sys.path.insert(0, {str(site)!r}); import attngen.cli; "
        f"assert attngen.cli.__file__.startswith({str(site)!r}), attngen.cli.__file__; "
        "sys.exit(attngen.cli.main(['build', 'specs/causal.toml', '--out', 'out']))"
    )
    subprocess.run([sys.executable, "-I", "-c", script], check=True, cwd=elsewhere)
    built = sorted(p.name for p in (elsewhere / "out" / "causal").iterdir())
    assert built == ["__init__.py", "pallas_tpu.py", "triton_gpu.py"]
    committed = (ROOT / "generated" / "causal" / "triton_gpu.py").read_text()
    assert (elsewhere / "out" / "causal" / "triton_gpu.py").read_text() == committed


def test_generated_code_spaces_its_definitions_as_pep8_does(tmp_path):
    """Generated modules keep PEP 8's blank lines (ruff's E30 rules: two before each top-level
    definition, never more than two in a row), with the spec's Hopper kernels and with none."""
    no_hopper = dict.fromkeys(("sm90_forward", "sm90_fp8", "sm90_backward", "sm90_dq", "sm90_fused_backward"), 0)
    for spec_file in SPECS:
        spec = load_spec(spec_file.relative_to(ROOT))
        for label, variant in (("hopper", spec), ("no_hopper", with_config(spec, "triton_gpu", **no_hopper))):
            folder = tmp_path / f"{spec.name}_{label}"
            folder.mkdir()
            for name, source in package_sources(variant).items():
                (folder / name).write_text(source)
    ruff = [sys.executable, "-m", "ruff", "check", "--isolated", "--preview", "--select", "E30,W391"]
    result = subprocess.run(
        [*ruff, "--output-format", "concise", str(tmp_path)], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
