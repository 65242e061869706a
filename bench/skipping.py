"""`attngen explain`'s prediction against the measured speed-up over the dense kernel, on a GPU.

For masks that skip tiles (sliding windows of 256..4096 keys, causal, chunked) at 16k tokens, bf16,
D = 128, 16 heads: `attngen.explain` gives the fraction of tiles the launched kernels skip and the
roofline speed-up over the same kernels visiting every tile; the GPU gives the time of the spec's
module against the `full` spec's (the dense kernel: the same kernels, nothing masked), forward and
forward + backward, in the same run (triton.testing.do_bench, median).

    python bench/skipping.py

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
from attngen.explain import ACCELERATORS, Problem, explain
from attngen.spec import load_spec, retarget
from attngen.timing import median_ms

ROOT = Path(__file__).resolve().parent.parent
SEQ, HEADS, HEAD_DIM = 16384, 16, 128
ROWS = (  # (spec, its params)
    ("sliding_window", {"window": 256}),
    ("sliding_window", {"window": 1024}),
    ("sliding_window", {"window": 4096}),
    ("causal", {}),
    ("chunked", {"chunk": 2048}),
)


def spec_of(name: str):
    return retarget(load_spec(ROOT / "specs" / f"{name}.toml"), HEAD_DIM, "bfloat16")


def measure(module, params: dict, q, k, v, dout) -> dict:
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    return {
        "fwd": median_ms(lambda: module.attention(q, k, v, **params)),
        "fwd_bwd": median_ms(lambda: torch.autograd.grad(module.attention(*leaves, **params), leaves, dout)),
    }


def predicted(name: str, params: dict) -> dict:
    """Skipped tiles of the launched forward and the roofline speed-ups, forward and training step."""
    ex = explain(spec_of(name), Problem(SEQ, SEQ, 1, HEADS), params={k: str(v) for k, v in params.items()})
    chip = ACCELERATORS[ex.accelerator]
    launched = [ex.maps[n] for n in ex.launched if ex.maps[n].kind != "decode"]
    forward = next(m for m in launched if m.kind == "forward")
    step = sum(m.cost.time(chip) for m in launched), sum(m.dense.time(chip) for m in launched)
    return {
        "skipped": forward.skipped,
        "fwd": forward.dense.time(chip) / forward.cost.time(chip),
        "fwd_bwd": step[1] / step[0],
    }


def main() -> None:
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    q, k, v, dout = (torch.randn(1, HEADS, SEQ, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    dense = measure(load(spec_of("full")), {}, q, k, v, dout)
    rows = []
    for name, params in ROWS:
        ms = measure(load(spec_of(name)), params, q, k, v, dout)
        rows.append({"spec": name, "params": params, "ms": ms, "predicted": predicted(name, params)})
        print(rows[-1], flush=True)
    (out_dir / "results.json").write_text(json.dumps({"environment": env, "dense_ms": dense, "rows": rows}, indent=1))
    print(f"\n{env}\nB=1, H={HEADS}, N={SEQ}, D={HEAD_DIM}, bf16; dense = specs/full.toml: {dense} ms")
    print(f"{'spec':28} {'skipped':>8} {'fwd pred':>9} {'fwd meas':>9} {'f+b pred':>9} {'f+b meas':>9}")
    for r in rows:
        label = r["spec"] + "".join(f" {k}={v}" for k, v in r["params"].items())
        p, ms = r["predicted"], r["ms"]
        print(
            f"{label:28} {p['skipped']:8.1%} {p['fwd']:8.2f}x {dense['fwd'] / ms['fwd']:8.2f}x"
            f" {p['fwd_bwd']:8.2f}x {dense['fwd_bwd'] / ms['fwd_bwd']:8.2f}x"
        )


if __name__ == "__main__":
    main()
