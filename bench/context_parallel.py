"""Context parallelism's compute on one GPU: each rank's share of a ring, against the whole problem.

With one GPU lent, this measures what a W-GPU ring can reach at best: every rank's kernels (the
block pairs attngen.parallel's ring runs for that rank, in its order: forward then backward),
timed one rank at a time on this GPU, against the one-GPU kernels on the whole sequence. The
slowest rank bounds the W-GPU step; K/V transfers overlap the kernels in the ring (their bytes per
step are printed beside the step's compute). The merged outputs of all ranks are checked against
the one-GPU output first.

bf16, B = 1, 16 heads of 128, causal at 64k tokens (zigzag and contiguous layouts) and a sliding
window of 4096 (whose distant block pairs launch nothing).

    python bench/context_parallel.py

Prints a table last; writes results.json to $OUT (or ./bench-out).
"""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from attngen import load
from attngen.parallel import ShardedSpec
from attngen.parallel.torch_distributed import _Call
from attngen.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
HEADS, DIM, LENGTH = 16, 128, 65536
ROWS = [("causal", {}, 2, "zigzag"), ("causal", {}, 2, "contiguous"), ("causal", {}, 4, "zigzag"),
        ("sliding_window", {"window": 4096}, 2, "contiguous"), ("sliding_window", {"window": 4096}, 4, "contiguous")]  # fmt: skip


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


def rank_work(sharded, module, world, rank, layout, params, q, k, v, dout):
    """Rank `rank`'s ring as closures (forward, backward) over the whole tensors' slices, and its merged output."""
    cp = types.SimpleNamespace(world=world, rank=rank, layout=layout, sharded=sharded, module=module)
    call = _Call(cp, DIM**-0.5, params, (LENGTH, LENGTH))
    local = lambda x, r: torch.cat([x[:, :, s : s + n] for s, n in call.kv_pieces(r)], 2)
    q_local, dout_local = local(q, rank), local(dout, rank)
    steps = [
        (source, local(k, source), local(v, source), call.pairs[source])
        for source in ((rank - s) % world for s in range(world))
    ]

    def forward():
        out = torch.zeros(q_local.shape, device="cuda", dtype=torch.float32)
        lse = torch.full(q_local.shape[:3], float("-inf"), device="cuda")
        for _, k_block, v_block, pairs in steps:
            for rows, cols, args in pairs:
                part, part_lse = module.attention_forward(
                    q_local[:, :, rows], k_block[:, :, cols], v_block[:, :, cols], **args
                )
                out[:, :, rows], lse[:, :, rows] = module.merge_partials(
                    out[:, :, rows], lse[:, :, rows], part, part_lse
                )
        return out.to(q.dtype), lse

    out, lse = forward()
    dlse = torch.zeros_like(lse)

    def backward():  # as the ring's: float32 sums of dQ here and of each block's dK, dV
        dq = torch.zeros(q_local.shape, device="cuda", dtype=torch.float32)
        for _, k_block, v_block, pairs in steps:
            dk, dv = (torch.zeros(x.shape, device="cuda", dtype=torch.float32) for x in (k_block, v_block))
            for rows, cols, args in pairs:
                dq_part, dk_part, dv_part = module.attention_backward(
                    dout_local[:, :, rows], dlse[:, :, rows], q_local[:, :, rows], k_block[:, :, cols],
                    v_block[:, :, cols], out[:, :, rows], lse[:, :, rows], **args,
                )  # fmt: skip
                dq[:, :, rows] += dq_part
                dk[:, :, cols] += dk_part
                dv[:, :, cols] += dv_part

    pairs = sum(len(p) for *_, p in steps)
    return forward, backward, out, call, pairs


def row(name, params, world, layout) -> dict:
    spec = load_spec(ROOT / "specs" / f"{name}.toml")
    whole, sharded = load(spec, "triton_gpu"), ShardedSpec.of(spec)
    module = sharded.module("triton_gpu")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (
        torch.randn(1, HEADS, LENGTH, DIM, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4)
    )
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    one_out = whole.attention(*leaves, **params)
    one_gpu = time_ms(lambda: torch.autograd.grad(whole.attention(*leaves, **params), leaves, dout))
    one_fwd = time_ms(lambda: whole.attention(q, k, v, **params))
    ranks, error = [], 0.0
    for rank in range(world):
        forward, backward, out, call, pairs = rank_work(sharded, module, world, rank, layout, params, q, k, v, dout)
        expected = torch.cat([one_out[:, :, s : s + n] for s, n in call.q_pieces], 2)
        error = max(error, (out.float() - expected.float()).abs().max().item())
        ranks.append({"rank": rank, "pairs": pairs, "fwd_ms": time_ms(forward), "bwd_ms": time_ms(backward)})
    slowest = max(r["fwd_ms"] + r["bwd_ms"] for r in ranks)
    kv_bytes = 2 * k.numel() * k.element_size() // world  # one rank's K and V, passed on each step
    return {
        "spec": name, "params": params, "world": world, "layout": layout, "one_gpu_fb_ms": one_gpu, "one_gpu_fwd_ms": one_fwd,
        "ranks": ranks, "slowest_rank_fb_ms": slowest, "ratio": slowest / one_gpu, "balance": min(r["fwd_ms"] + r["bwd_ms"] for r in ranks) / slowest,
        "kv_bytes_per_step": kv_bytes, "max_abs_diff_vs_one_gpu": error,
    }  # fmt: skip


def main():
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    rows = [row(*r) for r in ROWS]
    (out_dir / "results.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    print(env)
    print(f"B=1 H={HEADS} D={DIM} N={LENGTH} bf16; fwd+bwd ms; ratio = slowest rank / one GPU (ideal 1/W)")
    print("| spec | W | layout | 1 GPU | per rank | slowest / 1 GPU | balance | K/V MB per step | max diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        per_rank = " / ".join(f"{x['fwd_ms'] + x['bwd_ms']:.1f}" for x in r["ranks"])
        print(
            f"| {r['spec']} | {r['world']} | {r['layout']} | {r['one_gpu_fb_ms']:.1f} | {per_rank} | {r['ratio']:.3f} "
            f"| {r['balance']:.2f} | {r['kv_bytes_per_step'] / 2**20:.0f} | {r['max_abs_diff_vs_one_gpu']:.1e} |"
        )


if __name__ == "__main__":
    main()
