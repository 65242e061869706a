"""What a sink costs: specs/sinks.toml against specs/causal.toml at the same shapes, on a GPU.

bf16, causal, B·N = 16k tokens, H·D = 2048, D = 64 and 128, N = 4k and 16k; each spec with its
default kernels (the Hopper ones at D = 128 on an H200). Forward and forward + backward (the sinks'
gradient included), triton.testing.do_bench medians, the two specs interleaved row by row. The
sinks spec is checked against float64 first (tests/test_gpu.py::test_sinks_on_the_gpu proves the
gradients).

    python bench/sinks.py

Prints a table last; writes results.json to $OUT (or ./bench-out).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen import load
from attngen.exactness import judge
from attngen.reference import attention_ref_torch
from attngen.spec import load_spec, retarget
from attngen.timing import median_ms

ROOT = Path(__file__).resolve().parent.parent
TOKENS, HEADS_TIMES_DIM = 16384, 2048


def row(head_dim: int, seq: int) -> dict:
    batch, heads = TOKENS // seq, HEADS_TIMES_DIM // head_dim
    specs = {
        name: retarget(load_spec(ROOT / "specs" / f"{name}.toml"), head_dim, "bfloat16") for name in ("causal", "sinks")
    }
    modules = {name: load(spec, "triton_gpu") for name, spec in specs.items()}
    q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    sinks = 2 * torch.randn(heads, device="cuda")
    # Exactness of the sinks forward at this length (one sequence of two heads: the float64
    # reference holds its scores).
    small = [x[:1, :2] for x in (q, k, v)]
    ref, _ = attention_ref_torch(specs["sinks"], *small, sinks=sinks[:2])
    low, _ = attention_ref_torch(specs["sinks"], *small, sinks=sinks[:2], dtype=torch.bfloat16)
    out = modules["sinks"].attention(*small, sinks=sinks[:2])
    error = (out.double() - ref).abs().max().item()
    ok = judge("bfloat16", {"out": error}, {"out": (low.double() - ref).abs().max().item()}).ok

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    learned = sinks.detach().requires_grad_()
    params = {"causal": {}, "sinks": {"sinks": learned}}
    inputs = {"causal": leaves, "sinks": [*leaves, learned]}
    times = {}
    for name, module in modules.items():
        times[name] = {
            "fwd": median_ms(lambda m=module, p=params[name]: m.attention(q, k, v, **p)),
            "fwd_bwd": median_ms(
                lambda m=module, p=params[name], x=inputs[name]: torch.autograd.grad(m.attention(*leaves, **p), x, dout)
            ),
        }
    return {"head_dim": head_dim, "seq": seq, "batch": batch, "heads": heads, "error": error, "exact": ok, "ms": times}


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows = []
    for head_dim in (64, 128):
        for seq in (4096, 16384):
            rows.append(row(head_dim, seq))
            print(rows[-1], flush=True)
            (out_dir / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    print(f"\n{env}\nms (median); sinks ÷ causal in time (< 1.05: within 5 %)")
    print(
        f"{'D':>4} {'N':>6} {'exact':>6} {'fwd causal':>11} {'fwd sinks':>10} {'ratio':>6} {'f+b causal':>11} {'f+b sinks':>10} {'ratio':>6}"
    )
    for r in rows:
        c, s = r["ms"]["causal"], r["ms"]["sinks"]
        print(
            f"{r['head_dim']:4d} {r['seq']:6d} {r['exact']!s:>6} {c['fwd']:11.3f} {s['fwd']:10.3f} {s['fwd'] / c['fwd']:6.3f}"
            f" {c['fwd_bwd']:11.3f} {s['fwd_bwd']:10.3f} {s['fwd_bwd'] / c['fwd_bwd']:6.3f}"
        )


if __name__ == "__main__":
    main()
