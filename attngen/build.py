"""Stage: Spec -> generated/<name>/ package (one module per target), written deterministically.

Goals: render each target's template from its KernelPlan (Jinja, StrictUndefined), and write
files atomically and only when their bytes change. A file attngen did not write (its first line
is not attngen's header) is never overwritten, not even one that appears while a build runs;
builds of the same spec may run at once. Every failure to write is a BuildError.
Non-goals: no compilation; kernels compile when first called. Where a build may write is the
caller's decision (the CLI keeps it inside the project); this module writes where it is told.
"""

from __future__ import annotations

import importlib.resources
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
from attngen.errors import BuildError, shown_path
from attngen.plan import HEADER_NOTE, KernelPlan, make_plan
from attngen.spec import Spec, load_spec

# Templates are package data (attngen/templates/), loaded as resources: a wheel install builds too.
TEMPLATES = importlib.resources.files("attngen") / "templates"


# The package's __init__.py, small enough to need no template file (str.format fields).
PACKAGE_INIT = '''# {header_note}
# spec: {name} ({label}), sha256 {sha256}
"""Attention kernels of spec `{name}`: import one target module ({targets}).

Each target module imports only its own framework.
"""
'''


@dataclass(frozen=True)
class BuiltFile:
    path: Path
    changed: bool


@cache
def _environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.PackageLoader("attngen", "templates"),
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
    """How generated headers name a spec file: relative to the working directory when inside it.

    The label goes into a comment of generated source, so anything unprintable in the path (a
    newline would end the comment and start code) is escaped.
    """
    path = Path(spec.path)
    try:
        label = path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except (ValueError, OSError):  # outside the working directory, or a path the OS rejects
        label = path.name
    return shown_path(label)


def package_sources(spec: Spec) -> dict[str, str]:
    """File name -> source of the generated package for spec."""
    files = {}
    for backend in TARGETS:
        files[backend.filename] = render(make_plan(spec, backend, spec_label(spec)), backend)
    files["__init__.py"] = PACKAGE_INIT.format(
        header_note=HEADER_NOTE,
        name=spec.name,
        label=spec_label(spec),
        sha256=spec.sha256,
        targets=", ".join(b.name for b in TARGETS),
    )
    return files


_HEADER_LINE = f"# {HEADER_NOTE}".encode()
# A writer that loses the race for a new file's name looks again; a name that keeps changing
# under attngen's feet (another program at work) ends the build instead.
_ATTEMPTS = 8


def _not_ours(target: Path) -> BuildError:
    return BuildError(
        f"{shown_path(target)} exists and was not written by attngen; move it away or choose another --out"
    )


def _current(target: Path) -> bytes | None:
    """The bytes of target, or None when nothing (not even a dangling link) has its name."""
    try:
        return target.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # (a file where the package folder should be)
        if target.is_symlink():
            raise _not_ours(target) from None
        return None
    except OSError:  # a folder, an unreadable file: not attngen's either way
        raise _not_ours(target) from None


def _is_ours(data: bytes) -> bool:
    return data.split(b"\n", 1)[0].rstrip(b"\r") == _HEADER_LINE


def _staged(target: Path, data: bytes) -> Path:
    """A new file beside target holding data, under a fresh name no other writer uses."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _write(target: Path, data: bytes) -> BuiltFile:
    """Make target hold data: a reader (or a concurrent build) sees the old file or the new one,
    never part of one, and a file attngen did not write is left alone."""
    for _ in range(_ATTEMPTS):
        current = _current(target)
        if current == data:
            return BuiltFile(target, changed=False)
        if current is not None and not _is_ours(current):
            raise _not_ours(target)
        tmp = _staged(target, data)
        try:
            if current is not None:
                os.replace(tmp, target)
                return BuiltFile(target, changed=True)
            try:
                os.link(tmp, target)  # unlike a rename, fails if the name was taken meanwhile
                return BuiltFile(target, changed=True)
            except FileExistsError:
                continue  # another writer was first: look at what it wrote
            except OSError:  # a file system without hard links: the rename is atomic still
                os.replace(tmp, target)
                return BuiltFile(target, changed=True)
        finally:
            tmp.unlink(missing_ok=True)
    raise BuildError(f"{shown_path(target)} kept changing while attngen wrote it; is another program writing there?")


def write_package(spec: Spec, out_dir: Path) -> list[BuiltFile]:
    """Write <out_dir>/<name>/; raises BuildError rather than clobber a user file or on any
    failure to write."""
    package = Path(out_dir) / spec.name
    sources = {name: source.encode() for name, source in package_sources(spec).items()}
    try:
        # Every name is checked before anything is written: a refusal leaves no half-built package.
        for name in sources:
            current = _current(package / name)
            if current is not None and not _is_ours(current):
                raise _not_ours(package / name)
        package.mkdir(parents=True, exist_ok=True)
        return [_write(package / name, data) for name, data in sources.items()]
    except OSError as e:
        raise BuildError(f"cannot write {shown_path(e.filename or package)}: {e.strerror or e}") from None
    except ValueError as e:  # a path no file system takes (a NUL byte)
        raise BuildError(f"cannot write {shown_path(package)}: {e}") from None


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
