"""GQA and MQA backward: the dK/dV kernel's split of each query-head group over programs, side by side.

With few kv heads, one dK/dV program per kv block and kv head makes a small grid, each program walking
its whole group of query heads. The generated `_backward` splits the group into parts (programs of their
own, writing float32 partial sums) by a rule, `_group_splits`. This script times every split a shape
allows against the rule's choice: for each spec, shape and number of parts, `_group_splits` is pinned to
that number, the kernel is checked against the float64 reference (attngen.tune.check_exact: out, dq, dk,
dv on fresh inputs, N = 512, the shape's heads and kv heads), then forward + backward is timed
(triton.testing.do_bench, median). Parts = 1 is the kernel without the split.

    python bench/splits.py --specs causal,full,document --shapes 4.16.1.4096,1.32.8.16384 \\
        [--head-dim 128] [--dtype bf16] [--out DIR]

A shape is batch.heads.kv_heads.seq. Prints one line per measurement and a table (ms) last; writes
splits.json under --out ($OUT by default).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="attngen-splits-triton-"))

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from speed import CASES, DTYPE_NAMES, Row, dense_visible

from attngen.build import import_generated, write_package
from attngen.spec import load_spec, retarget
from attngen.tune import Rejected, Workload, check_exact


def measure(module, spec, case, shape: tuple[int, ...], parts: int) -> dict:
    batch, heads, kv_heads, seq = shape
    device, dtype = torch.device("cuda"), getattr(torch, spec.dtype)
    module._group_splits = lambda group, programs, device: parts
    check = Row(case, spec.dtype, spec.head_dim, 1, heads, 512)
    try:
        check_exact(module, Workload(spec, case.params(check, device)), 512, heads, kv_heads)
    except Rejected as e:
        return {"error": str(e)}
    row = Row(case, spec.dtype, spec.head_dim, batch, heads, seq)
    params = case.params(row, device)
    visible = dense_visible(row, spec, params, device)
    density = 1.0 if visible is None else float(visible.count_nonzero()) / seq**2
    q, dout = (torch.randn(batch, heads, seq, spec.head_dim, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(batch, kv_heads, seq, spec.head_dim, device=device, dtype=dtype) for _ in range(2))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    ms = triton.testing.do_bench(
        lambda: torch.autograd.grad(module.attention(*leaves, **params), leaves, dout), return_mode="median"
    )
    return {"ms": ms, "tflops": 4 * batch * heads * seq**2 * spec.head_dim * density * 3.5 / ms / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", required=True, help="comma-separated case names of bench/speed.py")
    parser.add_argument("--shapes", required=True, help="comma-separated batch.heads.kv_heads.seq")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()
    shapes = [tuple(int(x) for x in s.split(".")) for s in args.shapes.split(",")]
    by_name = {c.name: c for c in CASES}
    scratch = Path(tempfile.mkdtemp(prefix="attngen-splits-"))
    results, lines = [], []
    for name in args.specs.split(","):
        case = by_name[name]
        spec = retarget(load_spec(ROOT / "specs" / f"{case.spec}.toml"), args.head_dim, DTYPE_NAMES[args.dtype])
        write_package(spec, scratch)
        module = import_generated(scratch / spec.name / "triton_gpu.py", f"attngen_splits_{spec.name}")
        rule = module._group_splits
        for shape in shapes:
            batch, heads, kv_heads, seq = shape
            group, programs = heads // kv_heads, batch * kv_heads * triton.cdiv(seq, module.DKDV_BLOCK_N)
            chosen = rule(group, programs, torch.device("cuda"))
            cells = []
            for parts in (p for p in range(1, group + 1) if group % p == 0):
                result = {"case": name, "shape": ".".join(map(str, shape)), "programs": programs, "parts": parts}
                result |= measure(module, spec, case, shape, parts) | {"rule": parts == chosen}
                print(result, flush=True)
                results.append(result)
                shown = f"{result['ms']:.2f}" if "ms" in result else "not exact"
                cells.append(f"{parts}: {shown}{' (rule)' if parts == chosen else ''}")
            module._group_splits = rule
            lines.append(f"| {name} | {'×'.join(map(str, shape[:3]))} | {seq} | {programs} | {' · '.join(cells)} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "splits.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{args.dtype} D={args.head_dim}, forward+backward ms by parts of each group")
    print("| case | B×H×H_kv | N | programs unsplit | parts: ms |\n|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
