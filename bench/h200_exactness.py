"""Run the generated Triton kernels of specs/ at real sizes on a GPU: exactness, then rough speed.

For every spec in specs/ and dtype in (float16, bfloat16): build the package, run it on fresh
random inputs, compare with the float64 oracle (attngen.reference) and with torch SDPA in the
same precision (the FlashAttention rule: our error <= 2x SDPA's error + a small floor), then time
ours and SDPA with triton.testing.do_bench (median). Prints a table last; writes JSON to $OUT.

    python bench/h200_exactness.py [--batch 2 --heads 8 --seq 2048]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from attngen.build import write_package  # noqa: E402
from attngen.reference import attention_ref, dense_mask  # noqa: E402
from attngen.spec import load_spec  # noqa: E402

PARAMS = {"sliding_window": {"window": 256}, "prefix_lm": {"prefix": 512}, "softcap": {"softcap": 20.0}, "strided": {"stride": 64}}
FLOOR = {"float16": 1e-4, "bfloat16": 1e-3}


def load_kernel(spec, out_dir: Path):
    write_package(spec, out_dir)
    path = out_dir / spec.name / "triton_gpu.py"
    name = f"{spec.name}_{spec.dtype}_triton"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def sdpa(spec, q, k, v, visible: torch.Tensor | None):
    """torch SDPA on the same mask; None where SDPA cannot express the spec (score modifiers)."""
    if spec.score is not None:
        return None
    if spec.mask_source == "q_idx >= kv_idx" and q.shape[2] == k.shape[2]:
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if spec.mask is None:
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    out_root = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    build_root = Path(tempfile.mkdtemp(prefix="attngen-h200-"))
    device = torch.device("cuda")
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)

    rows = []
    for spec_file in sorted((ROOT / "specs").glob("*.toml")):
        base = load_spec(spec_file)
        for dtype in ("float16", "bfloat16"):
            spec = dataclasses.replace(base, dtype=dtype)
            t0 = time.perf_counter()
            module = load_kernel(spec, build_root / dtype)
            params = PARAMS.get(spec.name, {})
            B, H, N, D = args.batch, args.heads, args.seq, spec.head_dim
            gen = torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(4), "little"))
            q, k, v = (torch.randn(B, H, N, D, device=device, dtype=getattr(torch, dtype), generator=gen) for _ in range(3))
            out, lse = module.attention(q, k, v, return_lse=True, **params)
            torch.cuda.synchronize()
            first_call_s = time.perf_counter() - t0

            ref_out, ref_lse = attention_ref(spec, q.double().cpu().numpy(), k.double().cpu().numpy(), v.double().cpu().numpy(), **params)
            err = float(np.abs(out.double().cpu().numpy() - ref_out).max())
            lse_err = float(np.nanmax(np.abs(lse.double().cpu().numpy() - ref_lse)))
            mask_np = dense_mask(spec, B, H, N, N, params)
            density = float(mask_np.mean())
            visible = torch.from_numpy(np.ascontiguousarray(mask_np)).to(device)
            peer = sdpa(spec, q, k, v, visible)
            peer_err = float(np.abs(peer().double().cpu().numpy() - ref_out).max()) if peer else None
            exact = not np.isnan(err) and (err <= 2 * peer_err + FLOOR[dtype] if peer_err is not None else err <= 2e-2)

            flops = 4 * B * H * N * N * D * density
            ms = triton.testing.do_bench(lambda: module.attention(q, k, v, **params), warmup=25, rep=200, return_mode="median")
            peer_ms = triton.testing.do_bench(peer, warmup=25, rep=200, return_mode="median") if peer else None
            row = {
                "spec": spec.name,
                "dtype": dtype,
                "shape": [B, H, N, D],
                "params": params,
                "mask_density": density,
                "first_call_s": first_call_s,
                "max_abs_err": err,
                "lse_max_abs_err": lse_err,
                "sdpa_max_abs_err": peer_err,
                "exact": bool(exact),
                "ms": ms,
                "tflops": flops / ms * 1e-9,
                "sdpa_ms": peer_ms,
                "sdpa_tflops": flops / peer_ms * 1e-9 if peer_ms else None,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)

    (out_root / "h200_exactness.json").write_text(json.dumps(rows, indent=2))
    print(f"\n{'spec':16} {'dtype':9} {'err':>9} {'sdpa err':>9} {'exact':>5} {'TFLOP/s':>8} {'SDPA':>8} {'ratio':>6} {'1st call':>8}")
    for r in rows:
        sdpa_err = f"{r['sdpa_max_abs_err']:.2e}" if r["sdpa_max_abs_err"] is not None else "n/a"
        sdpa_tf = f"{r['sdpa_tflops']:.0f}" if r["sdpa_tflops"] else "n/a"
        ratio = f"{r['tflops'] / r['sdpa_tflops']:.2f}" if r["sdpa_tflops"] else "n/a"
        print(f"{r['spec']:16} {r['dtype']:9} {r['max_abs_err']:9.2e} {sdpa_err:>9} {str(r['exact']):>5} {r['tflops']:8.0f} {sdpa_tf:>8} {ratio:>6} {r['first_call_s']:7.1f}s")
    if not all(r["exact"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
