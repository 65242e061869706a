"""Stage: Spec -> generated/<name>/ package (one module per target), written deterministically.

Goals: render each target's template from its KernelPlan (Jinja, StrictUndefined), and write
files atomically and only when their bytes change. A file attngen did not write is never
overwritten. Non-goals: no compilation; kernels compile when first called.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jinja2

from attngen.backends import TARGETS
from attngen.backends.base import Backend
from attngen.errors import BuildError
from attngen.plan import HEADER_NOTE, KernelPlan, make_plan
from attngen.spec import Spec, load_spec

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


@dataclass(frozen=True)
class BuiltFile:
    path: Path
    changed: bool


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(plan: KernelPlan, backend: Backend) -> str:
    """Source of `backend`'s module for `plan`."""
    template = _environment().get_template(backend.template)
    return template.render(plan=plan, header_note=HEADER_NOTE).rstrip("\n") + "\n"


def spec_label(spec: Spec) -> str:
    """How generated headers name a spec file: relative to the working directory when inside it."""
    path = Path(spec.path)
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.name


def package_sources(spec: Spec) -> dict[str, str]:
    """File name -> source of the generated package for spec."""
    files = {}
    for backend in TARGETS:
        files[backend.filename] = render(make_plan(spec, backend, spec_label(spec)), backend)
    names = ", ".join(b.name for b in TARGETS)
    files["__init__.py"] = (
        f"# {HEADER_NOTE}\n# spec: {spec.name} ({spec_label(spec)}), sha256 {spec.sha256}\n"
        f'"""Attention kernels of spec `{spec.name}`: import one target module ({names}).\n\n'
        "Each target module imports only its own framework.\n"
        '"""\n'
    )
    return files


def _is_ours(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as f:
            return f.readline().rstrip("\n") == f"# {HEADER_NOTE}"
    except (OSError, UnicodeDecodeError):
        return False


def write_package(spec: Spec, out_dir: Path) -> list[BuiltFile]:
    """Write generated/<name>/ under out_dir; raises BuildError rather than clobber a user file."""
    package = out_dir / spec.name
    sources = package_sources(spec)
    for name in sources:
        target = package / name
        if target.exists() and not _is_ours(target):
            raise BuildError(f"{target} exists and was not written by attngen; move it away or choose another --out")
    package.mkdir(parents=True, exist_ok=True)
    built = []
    for name, source in sources.items():
        target = package / name
        data = source.encode()
        if target.exists() and target.read_bytes() == data:
            built.append(BuiltFile(target, changed=False))
            continue
        # Atomic: a reader (or a concurrent build) sees the old file or the new one, never half.
        fd, tmp = tempfile.mkstemp(dir=package, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        built.append(BuiltFile(target, changed=True))
    return built


def import_generated(path: Path, module_name: str):
    """Import a generated target module from its file under a name of the caller's choosing."""
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    module_spec.loader.exec_module(module)
    return module


def build(spec_path: str | Path, out_dir: str | Path = "generated") -> list[BuiltFile]:
    """Validate a spec file and write its package."""
    return write_package(load_spec(spec_path), Path(out_dir))
