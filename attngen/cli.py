"""Command line: `attngen build SPEC_OR_DIR... [--out DIR]`."""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from attngen.build import build
from attngen.errors import AttngenError, SpecError


def _spec_files(paths: list[str]) -> list[Path]:
    files = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.glob("*.toml"))
            if not found:
                raise AttngenError(f"{path}: no *.toml specs in this folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise AttngenError(f"{path}: no such spec file or folder")
    return files


def _build(args: argparse.Namespace) -> int:
    files = _spec_files(args.specs)
    failures = 0
    for i, spec_file in enumerate(files, start=1):
        prefix = f"[{i}/{len(files)}] " if len(files) > 1 else ""
        try:
            built = build(spec_file, args.out)
        except SpecError as e:
            print(f"{prefix}{spec_file}: invalid spec\n{e}", file=sys.stderr)
            failures += 1
            continue
        changed = sum(f.changed for f in built)
        package = built[0].path.parent
        status = f"{changed} of {len(built)} files changed" if changed else "up to date"
        print(f"{prefix}{spec_file} -> {package}/ ({status})")
    return 2 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attngen", description="Compile attention specs into Triton and Pallas kernels."
    )
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="generate kernel packages from specs")
    build_cmd.add_argument("specs", nargs="+", help="spec files (.toml) or folders of them")
    build_cmd.add_argument("--out", default="generated", help="output folder (default: generated)")
    args = parser.parse_args(argv)
    try:
        return _build(args)
    except AttngenError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
