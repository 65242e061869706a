"""One kernel's tile configurations side by side, exactness first: the sweep behind a choice of tiles.

For each case of bench/speed.py (its spec, its params and its grid shape: B·N = 16k, H·D = 2048), each
sequence length and each configuration given, the spec is built with that configuration for one kernel
(fwd, bwd_dq or bwd_dkdv; the others as the spec has them), checked against the float64 reference
(attngen.tune.check_exact: out, dq, dk, dv on fresh inputs, N = 512), then timed with
triton.testing.do_bench (median): the forward alone for fwd, forward + backward for bwd_dq and bwd_dkdv.
A configuration is rows.step.num_warps.num_stages as `attngen tune` names them (attngen.tune.Candidate):
the block a program holds, the block it steps over (for fwd and bwd_dq: block_m.block_n; for bwd_dkdv the keys
held, then the query step). With --kernel fwd the configuration serves every length (short_kv_len = 0).
`attngen tune` searches a whole space and keeps a geometric mean; this script shows each case on its own.

    python bench/tiles.py --cases causal,sliding_window --seqs 1024,16384 --kernel fwd \\
        --configs 128.128.8.3,64.64.4.3 [--head-dim 128] [--dtype bf16] [--out DIR]

Prints one line per measurement and a table (TF/s) last; writes tiles.json under --out ($OUT by default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="attngen-tiles-triton-"))

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from speed import CASES, DTYPE_NAMES, HEADS_TIMES_DIM, TOKENS, Row, dense_visible

from attngen.backends.triton_gpu import TRITON_GPU
from attngen.build import import_generated, write_package
from attngen.spec import load_spec, retarget, with_config
from attngen.tune import Candidate, Rejected, Workload, check_exact


def build(spec, kernel: str, config: tuple[int, ...], scratch: Path):
    """The spec with `config` for `kernel`, built and imported."""
    fields = Candidate(*config).config(TRITON_GPU.kernel(kernel))
    if kernel == "fwd":
        fields["short_kv_len"] = 0
    tag = f"{spec.name}_{kernel}_{'_'.join(map(str, config))}"
    spec = dataclasses.replace(with_config(spec, "triton_gpu", **fields), name=tag)
    write_package(spec, scratch)
    return spec, import_generated(scratch / tag / "triton_gpu.py", f"attngen_tiles_{tag}")


def measure(case, spec, module, kernel: str, seq: int, head_dim: int) -> dict:
    device, dtype = torch.device("cuda"), getattr(torch, spec.dtype)
    check = Row(case, spec.dtype, head_dim, 1, 2, 512)
    try:
        check_exact(module, Workload(spec, case.params(check, device)), 512)
    except Rejected as e:
        return {"error": str(e)}
    row = Row(case, spec.dtype, head_dim, TOKENS // seq, HEADS_TIMES_DIM // head_dim, seq)
    params = case.params(row, device)
    visible = dense_visible(row, spec, params, device)
    density = 1.0 if visible is None else float(visible.count_nonzero()) / seq**2
    flops = 4 * row.batch * row.heads * seq**2 * head_dim * density * (1 if kernel == "fwd" else 3.5)
    q, k, v, dout = (torch.randn(row.batch, row.heads, seq, head_dim, device=device, dtype=dtype) for _ in range(4))
    if kernel == "fwd":
        ms = triton.testing.do_bench(lambda: module.attention(q, k, v, **params), return_mode="median")
    else:
        leaves = [x.requires_grad_() for x in (q, k, v)]
        ms = triton.testing.do_bench(
            lambda: torch.autograd.grad(module.attention(*leaves, **params), leaves, dout), return_mode="median"
        )
    return {"ms": ms, "tflops": flops / ms / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", required=True, help="comma-separated case names of bench/speed.py")
    parser.add_argument("--seqs", default="16384")
    parser.add_argument("--kernel", choices=("fwd", "bwd_dq", "bwd_dkdv"), default="fwd")
    parser.add_argument("--configs", required=True, help="comma-separated rows.step.num_warps.num_stages")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()
    configs = [tuple(int(x) for x in c.split(".")) for c in args.configs.split(",")]
    by_name = {c.name: c for c in CASES}
    scratch = Path(tempfile.mkdtemp(prefix="attngen-tiles-"))
    results = []
    for name in args.cases.split(","):
        case = by_name[name]
        base = retarget(load_spec(ROOT / "specs" / f"{case.spec}.toml"), args.head_dim, DTYPE_NAMES[args.dtype])
        for config in configs:
            spec, module = build(base, args.kernel, config, scratch)
            for seq in map(int, args.seqs.split(",")):
                result = {"case": name, "seq": seq, "kernel": args.kernel, "config": ".".join(map(str, config))}
                result |= measure(case, spec, module, args.kernel, seq, args.head_dim)
                print(result, flush=True)
                results.append(result)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiles.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"\n{args.dtype} D={args.head_dim}, {args.kernel} ({'fwd' if args.kernel == 'fwd' else 'fwd+bwd'} TF/s)")
    print(f"{'case':16s} {'N':>6s} " + " ".join(f"{'.'.join(map(str, c)):>12s}" for c in configs))
    for name in args.cases.split(","):
        for seq in map(int, args.seqs.split(",")):
            cells = [r for r in results if r["case"] == name and r["seq"] == seq]
            shown = (f"{r['tflops']:12.0f}" if "tflops" in r else f"{'not exact':>12s}" for r in cells)
            print(f"{name:16s} {seq:6d} " + " ".join(shown))


if __name__ == "__main__":
    main()
