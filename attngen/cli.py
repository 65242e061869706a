"""Command line: `attngen build SPEC_OR_DIR... [--out DIR] [--allow-outside]`, `attngen check SPEC... [--target T...]`,
`attngen list [SPEC_OR_DIR...]`, `attngen tune SPEC...`, `attngen explain SPEC [--q-len N ...]`, `attngen --version`.

Exit status: 0 when everything succeeded, 1 when `check` found a kernel that does not fit (or
`explain` a tile its kernel gets wrong), 2 for
anything the user can fix (an invalid spec, a file in the way, an --out outside the project),
each reported without a traceback (--debug shows one); 70 for a bug in attngen itself.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import attngen
from attngen.build import build, write_root_init
from attngen.check import DEFAULT_TARGET_NAMES, TARGET_NAMES
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
    if failures < len(files):  # a folder that received packages (a rejected spec writes nothing)
        write_root_init(out)
    return 2 if failures else 0


def _check(args: argparse.Namespace) -> int:
    from attngen.check import iter_check
    from attngen.spec import load_spec

    targets = tuple(args.target or DEFAULT_TARGET_NAMES)
    failed = invalid = False
    for spec_file in _spec_files(args.specs):
        try:
            spec = load_spec(spec_file)
        except SpecError as e:
            print(f"FAIL {shown_path(spec_file)}: invalid spec\n{e}")
            invalid = True
            continue
        print(f"{shown_path(spec_file)}: checking {', '.join(targets)} (a line per kernel as it compiles)", flush=True)
        for finding in iter_check(spec, targets):
            print(f"  {finding.line()}", flush=True)
            failed |= not finding.ok
    return 2 if invalid else 1 if failed else 0


def _list(args: argparse.Namespace) -> int:
    """One line per spec: what a user picks a variant by."""
    from attngen.plan import spec_text
    from attngen.spec import load_spec

    failures = 0
    for spec_file in _spec_files(args.specs):
        try:
            spec = load_spec(spec_file)
        except SpecError as e:
            print(f"{shown_path(spec_file)}: invalid spec\n{e}", file=sys.stderr)
            failures += 1
            continue
        params = ", ".join(f"{p.name}: {p.declared}" for p in spec.params) or "none"
        head_dim = spec.head_dim if spec.value_dim == spec.head_dim else f"{spec.head_dim} (v: {spec.value_dim})"
        print(
            f"{spec.name}: mask {spec_text(spec, 'mask')}; score {spec_text(spec, 'score')}; params {params};"
            f" {spec.dtype}; head_dim {head_dim}"
        )
    return 2 if failures else 0


def _explain(args: argparse.Namespace) -> int:
    from attngen.explain import Problem, explain, render, write_png
    from attngen.spec import load_spec

    given = {}
    for item in args.params:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise AttngenError(f"--params takes NAME=VALUE, got {shown(item)!r}")
        given[name] = value
    spec = load_spec(args.spec)
    problem = Problem(
        q_len=args.q_len,
        kv_len=args.kv_len if args.kv_len is not None else args.q_len,
        batch=args.batch,
        heads=args.heads,
        kv_heads=args.kv_heads,
        new_tokens=args.new_tokens,
    )
    explanation = explain(spec, problem, args.target, given, args.seed, args.gpu)
    print(render(explanation))
    png = write_png(explanation, Path(args.out) / f"{spec.name}_{args.target}_tiles.png")
    print(f"\ntile maps of {', '.join(explanation.launched)}, left to right: {shown_path(png)}")
    return 1 if any(m.unsound for m in explanation.maps.values()) else 0


def _tune(args: argparse.Namespace) -> int:
    from attngen.spec import load_spec
    from attngen.tune import main_tune

    return main_tune([load_spec(f) for f in _spec_files(args.specs)], args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="attngen", description="Compile attention specs into Triton and Pallas kernels."
    )
    parser.add_argument("--debug", action="store_true", help="show a traceback on errors")
    parser.add_argument("--version", action="version", version=f"attngen {attngen.__version__}")
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
        choices=TARGET_NAMES,
        help=f"a target to check (repeat for several; default: {', '.join(DEFAULT_TARGET_NAMES)})",
    )
    list_cmd = commands.add_parser("list", help="one line per spec: name, mask, score, params, dtype, head_dim")
    list_cmd.add_argument("specs", nargs="*", default=["specs"], help="spec files or folders (default: specs)")
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
    tune_cmd.add_argument(
        "--kernel", action="append", help="tune only this kernel (repeat; e.g. bwd_dq_sm90; default: all)"
    )
    tune_cmd.add_argument("--dry-run", action="store_true", help="print the winners; leave the tuned table as it is")
    explain_cmd = commands.add_parser(
        "explain",
        help="at one problem size: each kernel's tile map (EMPTY / PARTIAL / FULL), FLOPs, HBM bytes, roofline times"
        " and tile bounds; a PNG of the tile maps",
    )
    explain_cmd.add_argument("spec", help="a spec file (.toml)")
    explain_cmd.add_argument("--q-len", type=int, default=4096, help="queries (default 4096)")
    explain_cmd.add_argument("--kv-len", type=int, help="keys (default: --q-len)")
    explain_cmd.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    explain_cmd.add_argument("--heads", type=int, default=1, help="query heads (default 1)")
    explain_cmd.add_argument("--kv-heads", type=int, help="kv heads (GQA; default: --heads)")
    explain_cmd.add_argument(
        "--new-tokens", type=int, default=1, help="the decode kernel's new tokens, after kv_len - N cached (default 1)"
    )
    explain_cmd.add_argument("--target", default="triton_gpu", choices=("triton_gpu", "pallas_tpu"))
    explain_cmd.add_argument(
        "--params",
        nargs="+",
        action="extend",
        default=[],
        metavar="NAME=VALUE",
        help="scalar params the mask reads, e.g. --params window=1024; the rest (tensors too) come from"
        " attngen.testing.example_params",
    )
    explain_cmd.add_argument("--seed", type=int, default=0, help="seed of example tensor params (default 0)")
    explain_cmd.add_argument(
        "--gpu",
        "--accelerator",
        choices=("h100", "h200", "a100", "tpu-v5e", "tpu-v6e"),
        help="the chip whose kernels and roofline lead (default: h200 for triton_gpu, tpu-v6e for pallas_tpu)",
    )
    explain_cmd.add_argument("--out", default=".", help="folder for NAME_TARGET_tiles.png (default: .)")
    args = parser.parse_args(argv)
    try:
        run = {"build": _build, "check": _check, "list": _list, "tune": _tune, "explain": _explain}
        return run[args.command](args)
    except AttngenError as e:
        if args.debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`attngen explain ... | head`): nothing more to say
        sys.stdout = None  # so that the interpreter's final flush does not raise again
        return 0
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
