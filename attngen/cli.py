"""Command line: `attngen build SPEC_OR_DIR... [--out DIR] [--allow-outside]`, `attngen check SPEC... [--target T...]`.

Exit status: 0 when everything succeeded, 1 when `check` found a kernel that does not fit, 2 for
anything the user can fix (an invalid spec, a file in the way, an --out outside the project),
each reported without a traceback (--debug shows one); 70 for a bug in attngen itself.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

from attngen.build import build
from attngen.errors import AttngenError, BuildError, SpecError, shown, shown_path

EXIT_INTERNAL_ERROR = 70  # sysexits.h EX_SOFTWARE


def _spec_files(paths: list[str]) -> list[Path]:
    files = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(path.glob("*.toml"))
            if not found:
                raise AttngenError(f"{shown_path(path)}: no *.toml specs in this folder")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise AttngenError(f"{shown_path(path)}: no such spec file or folder")
    return files


def project_root(start: Path) -> Path:
    """The nearest folder from `start` up that holds pyproject.toml or .git; else `start`."""
    start = start.resolve()
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").exists() or (folder / ".git").exists():
            return folder
    return start


def _out_dir(out: str, allow_outside: bool) -> Path:
    """The --out folder, if the build may write there: inside the project, or anywhere when asked."""
    try:
        root, target = project_root(Path.cwd()), Path(out).resolve()  # resolved: a link counts where it leads
    except (OSError, ValueError) as e:  # a deleted working directory, a NUL in the path
        raise BuildError(f"cannot resolve --out {shown_path(out)}: {e}") from None
    if not allow_outside and not target.is_relative_to(root):
        raise BuildError(
            f"--out {shown_path(out)} is outside the project {shown_path(root)}; pass --allow-outside to write there"
        )
    return Path(out)


def _build(args: argparse.Namespace) -> int:
    out = _out_dir(args.out, args.allow_outside)
    files = _spec_files(args.specs)
    failures = 0
    for i, spec_file in enumerate(files, start=1):
        prefix = f"[{i}/{len(files)}] " if len(files) > 1 else ""
        try:
            built = build(spec_file, out)
        except SpecError as e:
            print(f"{prefix}{shown_path(spec_file)}: invalid spec\n{e}", file=sys.stderr)
            failures += 1
            continue
        except AttngenError as e:
            print(f"{prefix}{shown_path(spec_file)}: not built: {e}", file=sys.stderr)
            failures += 1
            continue
        changed = sum(f.changed for f in built)
        package = built[0].path.parent
        status = f"{changed} of {len(built)} files changed" if changed else "up to date"
        print(f"{prefix}{shown_path(spec_file)} -> {shown_path(package)}/ ({status})")
    return 2 if failures else 0


def _check(args: argparse.Namespace) -> int:
    from attngen.check import TARGET_NAMES, check_spec
    from attngen.spec import load_spec

    targets = tuple(args.target or TARGET_NAMES)
    failed = invalid = False
    for spec_file in _spec_files(args.specs):
        try:
            spec = load_spec(spec_file)
        except SpecError as e:
            print(f"FAIL {shown_path(spec_file)}: invalid spec\n{e}")
            invalid = True
            continue
        print(f"{shown_path(spec_file)}: checking {', '.join(targets)}", flush=True)
        for finding in check_spec(spec, targets):
            print(f"  {finding.line()}", flush=True)
            failed |= not finding.ok
    return 2 if invalid else 1 if failed else 0


def _tune(args: argparse.Namespace) -> int:
    from attngen.spec import load_spec
    from attngen.tune import main_tune

    return main_tune([load_spec(f) for f in _spec_files(args.specs)], args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attngen", description="Compile attention specs into Triton and Pallas kernels."
    )
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    commands = parser.add_subparsers(dest="command", required=True)
    build_cmd = commands.add_parser("build", help="generate kernel packages from specs")
    build_cmd.add_argument("specs", nargs="+", help="spec files (.toml) or folders of them")
    build_cmd.add_argument("--out", default="generated", help="output folder (default: generated)")
    build_cmd.add_argument(
        "--allow-outside",
        action="store_true",
        help="let --out lie outside the project (the nearest folder up with pyproject.toml or .git)",
    )
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
    tune_cmd = commands.add_parser(
        "tune", help="search the Triton kernels' tiles on this GPU and record the winners in the tuned table"
    )
    tune_cmd.add_argument("specs", nargs="+", help="specs whose masks and scores make the workload (e.g. causal, full)")
    tune_cmd.add_argument(
        "--head-dim", type=int, action="append", help="head_dim to tune (repeat; default: the specs')"
    )
    tune_cmd.add_argument(
        "--dtype",
        action="append",
        choices=("bfloat16", "float16", "float32"),
        help="dtype (repeat; default: the specs')",
    )
    tune_cmd.add_argument(
        "--seq",
        type=int,
        action="append",
        help="sequence length timed, batch * seq = 16k (repeat; default: 1k, 4k, 16k)",
    )
    tune_cmd.add_argument("--param", action="append", help="a value for a spec param: NAME=VALUE")
    tune_cmd.add_argument("--quick", action="store_true", help="6 candidates per kernel instead of 36")
    tune_cmd.add_argument("--dry-run", action="store_true", help="print the winners; leave the tuned table as it is")
    args = parser.parse_args(argv)
    try:
        return {"build": _build, "check": _check, "tune": _tune}[args.command](args)
    except AttngenError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001  (a bug in attngen: said plainly, the traceback on request)
        if args.debug:
            traceback.print_exc()
        print(
            f"internal error: {type(e).__name__}: {shown(str(e), 200)}\n"
            "This is a bug in attngen; please report it with the output of --debug.",
            file=sys.stderr,
        )
        return EXIT_INTERNAL_ERROR


if __name__ == "__main__":
    sys.exit(main())
