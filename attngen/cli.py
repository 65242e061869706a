"""Command line: `attngen build SPEC_OR_DIR... [--out DIR]`, `attngen check SPEC... [--target T...]`."""

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


def _check(args: argparse.Namespace) -> int:
    from attngen.check import TARGET_NAMES, check_spec
    from attngen.spec import load_spec

    targets = tuple(args.target or TARGET_NAMES)
    failed = False
    for spec_file in _spec_files(args.specs):
        try:
            spec = load_spec(spec_file)
        except SpecError as e:
            print(f"FAIL {spec_file}: invalid spec\n{e}")
            failed = True
            continue
        print(f"{spec_file}: checking {', '.join(targets)}", flush=True)
        for finding in check_spec(spec, targets):
            print(f"  {finding.line()}", flush=True)
            failed |= not finding.ok
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attngen", description="Compile attention specs into Triton and Pallas kernels."
    )
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="generate kernel packages from specs")
    build_cmd.add_argument("specs", nargs="+", help="spec files (.toml) or folders of them")
    build_cmd.add_argument("--out", default="generated", help="output folder (default: generated)")
    check_cmd = commands.add_parser(
        "check", help="compile the kernels ahead of time for GPUs and TPUs and check their limits"
    )
    check_cmd.add_argument("specs", nargs="+", help="spec files (.toml) or folders of them")
    check_cmd.add_argument(
        "--target",
        action="append",
        choices=("sm90", "sm80", "tpu-v5e", "tpu-v5p", "tpu-v6e"),
        help="a target to check (repeat for several; default: all)",
    )
    args = parser.parse_args(argv)
    try:
        return _build(args) if args.command == "build" else _check(args)
    except AttngenError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
