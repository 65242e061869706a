"""The FP8 forward (attention_fp8, Hopper) against our bf16 forward and the peers, in one run on an H200.

Rows: causal and full at D = 128 and 64, N = 4k / 8k / 16k, B·N = 16k tokens, H·D = 2048 (the grid
of bench/speed.py). Each row times the forward of:
  fp8         attention_fp8 on e4m3 q, k, v with per-head descales (the call: V's transposed copy,
              the descale table, the kernel),
  fp8 kernel  the same kernel alone, on a V^T made beforehand,
  bf16        attention on the same values in bf16 (our Hopper forward, the default at D = 128),
  cuDNN, FA2  SDPA's backends in bf16.
Before timing, the FP8 forward is checked at the row's length (one sequence, two heads, fresh
inputs) by attngen.exactness's FP8 rule against float64 on the true values, and its error is shown
beside that of our bf16 forward on the same values. Times: triton.testing.do_bench medians, each
call timed once a round in turn with the others, the order reversed every other round, the median of
the rounds (attngen.timing).

    python bench/fp8.py [--seqs 4096,8192,16384] [--head-dims 128,64] [--only causal,full]

Prints a table last; writes results.json to $OUT (or ./bench-out).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen import load
from attngen.exactness import FP8, check_forward
from attngen.reference import attention_ref_torch
from attngen.spec import load_spec, retarget
from attngen.testing import fp8_quantized
from attngen.timing import median_ms, medians

ROOT = Path(__file__).resolve().parent.parent
TOKENS, HEADS_TIMES_DIM = 16384, 2048
IMPLS = ("fp8", "fp8 kernel", "bf16", "cuDNN", "FA2")


def quantized(shape, generator):
    """Fresh normal values as attention_fp8 takes them: (e4m3, descale, true values in float32)."""
    x = torch.randn(shape, device="cuda", generator=generator)
    return fp8_quantized(x, shape[1])


def exactness(spec, module, seq, head_dim, generator) -> dict:
    """The FP8 forward at this length (one sequence, two heads) by the FP8 rule; the bf16 forward's
    error on the same true values beside it."""
    (q8, qd, q), (k8, kd, k), (v8, vd, v) = (quantized((1, 2, seq, head_dim), generator) for _ in range(3))
    out, lse = module.attention_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True)
    ref_out, ref_lse = attention_ref_torch(spec, q, k, v)
    base_out, _ = attention_ref_torch(spec, q, k, v, dtype=torch.float32, fp8_probs=True)
    verdict = check_forward(FP8, out, lse, ref_out, ref_lse, base_out.bfloat16())
    bf16 = module.attention(q.bfloat16(), k.bfloat16(), v.bfloat16())
    return {
        "ok": verdict.ok,
        "message": verdict.message,
        "fp8_error": verdict.errors.get("out"),
        "bf16_error": (bf16.double() - ref_out).abs().max().item(),
    }


def run_row(mask: str, head_dim: int, seq: int) -> dict:
    batch, heads = TOKENS // seq, HEADS_TIMES_DIM // head_dim
    spec = retarget(load_spec(ROOT / "specs" / f"{mask}.toml"), head_dim, "bfloat16")
    module = load(spec, "triton_gpu")
    generator = torch.Generator(device="cuda").manual_seed(seq + head_dim)
    check = exactness(spec, module, seq, head_dim, generator)
    shape = (batch, heads, seq, head_dim)
    (q8, qd, q), (k8, kd, k), (v8, vd, v) = (quantized(shape, generator) for _ in range(3))
    q16, k16, v16 = (x.bfloat16() for x in (q, k, v))
    scale = head_dim**-0.5
    vt = module._fp8_transposed(v8)
    descale = module._fp8_descales(q8.device, *k8.shape[:2], qd, kd, vd)
    out = torch.empty_like(q16)
    lse = torch.empty(q.shape[:3], device="cuda")
    causal = mask == "causal"
    impls = {
        "fp8": lambda: module.attention_fp8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd),
        "fp8 kernel": lambda: module._forward_sm90(q8, k8, vt, out, lse, scale, [], descale),
        "bf16": lambda: module.attention(q16, k16, v16),
    }
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FA2", SDPBackend.FLASH_ATTENTION)):

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q16, k16, v16, is_causal=causal)

        impls[name] = sdpa
    flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)
    timings = {}

    def failed(name, e):
        timings[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}  # a peer that cannot run this row

    with torch.no_grad():  # in rounds of alternating order (attngen.timing)
        calls = {name: functools.partial(median_ms, fn) for name, fn in impls.items()}
        for name, ms in medians(calls, failed=failed).items():
            timings[name] = {"ms": ms, "tflops": flops / ms * 1e-9}
    return {"mask": mask, "head_dim": head_dim, "seq": seq, "batch": batch, "heads": heads, "check": check,
            "timings": timings}  # fmt: skip


def table(rows: list[dict]) -> str:
    header = ["mask", "D", "N", "fp8 TFLOP/s", "kernel", "bf16", "cuDNN", "FA2", "fp8/bf16", "kernel/bf16",
              "fp8/cuDNN", "err fp8", "err bf16"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        t = {name: r["timings"].get(name, {}).get("tflops") for name in IMPLS}
        ratio = lambda a, b, t=t: f"{t[a] / t[b]:.2f}" if t[a] and t[b] else "-"
        cells = [r["mask"], r["head_dim"], r["seq"]] + [f"{t[name]:.0f}" if t[name] else "-" for name in IMPLS]
        cells += [ratio("fp8", "bf16"), ratio("fp8 kernel", "bf16"), ratio("fp8", "cuDNN")]
        check = r["check"]
        cells += [f"{check['fp8_error']:.3g}{'' if check['ok'] else ' FAIL'}", f"{check['bf16_error']:.3g}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", default="4096,8192,16384")
    parser.add_argument("--head-dims", default="128,64")
    parser.add_argument("--only", default="causal,full")
    args = parser.parse_args()
    rows = []
    for head_dim in map(int, args.head_dims.split(",")):
        for mask in args.only.split(","):
            for seq in map(int, args.seqs.split(",")):
                rows.append(run_row(mask, head_dim, seq))
                print(json.dumps(rows[-1]), flush=True)
    out = Path(os.environ.get("OUT", "bench-out"))
    out.mkdir(parents=True, exist_ok=True)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    (out / "results.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
    print(info)
    print(table(rows))


if __name__ == "__main__":
    main()
