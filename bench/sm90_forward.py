"""The Hopper kernels (Gluon, sm90) against our Triton kernels and the peers, in one run on an H200.

Rows: the grid of bench/speed.py (causal and full, bf16, D = 64 / 128, N = 1k / 4k / 16k at B·N =
16k tokens, H·D = 2048), then the mask and score rows at D = 128, N = 16k (a full bias at 4k, its
tensor growing as N²). Each row times the forward and forward + backward of: ours with the Hopper
kernels ("sm90": the Gluon forward, dQ and dK/dV kernels where they serve the call, as a spec's
sm90_forward_min_keys sends short programs to the Triton forward; the fused backward wherever it
can run, at every length), the same with the dQ and dK/dV kernels in place of the fused backward
("split": SM90_FUSED_BACKWARD = 0, what deterministic calls run), the same module with the Hopper
kernels turned off ("triton": SM90_FORWARD = SM90_DQ = SM90_BACKWARD = 0 around the whole timed
call, the Triton kernels alone), and the peers -- SDPA's cuDNN and FlashAttention-2 backends where
they express the mask, else compiled FlexAttention. Before timing, each of our two forwards is
checked against float64 at the row's length (one sequence, two heads, fresh inputs), by
attngen.exactness's rule with the reference run in bf16 as the baseline; the gradients are proven
in tests/test_gpu.py.
Times: triton.testing.do_bench medians, each call timed once a round in turn with the others, the
order reversed every other round, the median of the rounds (attngen.timing).
--graphs also times each call replayed from a CUDA graph, the kernels' time without the host's, and
reports each eager call's host time: an eager forward + backward of ours spends 0.7-0.95 ms of it
(Triton's launcher, the descriptors, autograd's device thread), so rows of less than ~1 ms measure
more than the kernels.

    python bench/sm90_forward.py [--seqs 1024,4096,16384] [--head-dims 64,128] [--only causal,full]
                                 [--sm90-everywhere] [--graphs]

Prints a table last; writes results.json to $OUT (or ./bench-out).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decode import graphed, host_time
from speed import CASES, HEADS_TIMES_DIM, TOKENS, Row

from attngen import load
from attngen.exactness import judge
from attngen.reference import attention_ref_torch
from attngen.spec import load_spec, retarget, with_config
from attngen.timing import median_ms, medians

ROOT = Path(__file__).resolve().parent.parent
MASK_ROWS = ("sliding_window", "prefix_lm", "document", "chunked", "alibi_slopes", "relative_bias", "bias")
IMPLS = ("sm90", "split", "triton", "cuDNN", "FA2", "Flex")


def switched_time(switch, fn) -> float:
    """median_ms of fn with `switch` (our kernels' switches, or nothing for a peer) on around it."""
    with switch():
        return median_ms(fn)


def exact(spec, module, case, row: Row) -> dict:
    """Max error of our forward against float64 at the row's length with one sequence of two heads
    (fresh inputs and params), judged with the reference run in bf16 as the baseline."""
    small = Row(case, row.dtype, row.head_dim, 1, 2, row.seq)
    device = torch.device("cuda")
    q, k, v = (torch.randn(1, 2, row.seq, row.head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    params = case.params(small, device)
    ref, _ = attention_ref_torch(spec, q, k, v, **params)
    low, _ = attention_ref_torch(spec, q, k, v, dtype=q.dtype, **params)
    out = module.attention(q, k, v, **params)
    errors = {"out": (out.double() - ref).abs().max().item()}
    verdict = judge(
        spec.dtype, errors, {"out": (low.double() - ref).abs().max().item()}, {"out": ref.abs().max().item()}
    )
    return {"errors": errors, "ok": verdict.ok}


def run_row(case, head_dim: int, seq: int, sm90_everywhere: bool, graphs: bool) -> dict:
    row = Row(case, "bfloat16", head_dim, TOKENS // seq, HEADS_TIMES_DIM // head_dim, seq)
    device = torch.device("cuda")
    spec = retarget(load_spec(ROOT / "specs" / f"{case.spec}.toml"), head_dim, "bfloat16")
    if sm90_everywhere:  # also where the defaults leave them out (head dims of 64), to measure them there
        spec = with_config(spec, "triton_gpu", sm90_forward=1, sm90_backward=1, sm90_dq=1)
    if spec.config("triton_gpu").sm90_backward and head_dim <= 128:  # (the fused backward, wherever it can run)
        spec = with_config(spec, "triton_gpu", sm90_fused_backward=1, sm90_fused_min_queries=0)
    module = load(spec, "triton_gpu")
    q, k, v, dout = (
        torch.randn(row.batch, row.heads, seq, head_dim, device=device, dtype=torch.bfloat16) for _ in range(4)
    )
    params = case.params(row, device)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    impls = {}

    # 0 where the spec's config leaves a Hopper kernel out of the module.
    switches = ("SM90_FORWARD", "SM90_DQ", "SM90_BACKWARD", "SM90_FUSED_BACKWARD")
    built = {switch: getattr(module, switch, 0) for switch in switches}
    off = {"sm90": (), "split": ("SM90_FUSED_BACKWARD",), "triton": switches}

    @contextlib.contextmanager
    def kernels(name: str):
        """Ours with the Hopper kernels that the module builds, less those `off[name]` turns off:
        around the whole timed call, so that the backward runs the same kernels as the forward."""
        for switch, value in built.items():
            setattr(module, switch, 0 if switch in off[name] else value)
        try:
            yield
        finally:
            for switch, value in built.items():
                setattr(module, switch, value)

    checks, switched = {}, {}
    for name in off:
        if name == "sm90" and not any(built.values()) or name == "split" and not built["SM90_FUSED_BACKWARD"]:
            continue
        with kernels(name):
            checks[name] = exact(spec, module, case, row)
        impls[name] = lambda *qkv: module.attention(*qkv, **params)
        switched[name] = functools.partial(kernels, name)
    if case.sdpa:
        for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FA2", SDPBackend.FLASH_ATTENTION)):

            def sdpa(*qkv, backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=case.sdpa == "causal")

            impls[name] = sdpa
    else:  # FlexAttention where SDPA cannot express the mask (its compile costs a minute a row)
        mask_mod = case.mask_mod(params, device) if case.mask_mod else None
        block_mask = create_block_mask(mask_mod, row.batch, row.heads, seq, seq, device=device) if mask_mod else None
        score_mod = case.score_mod(params, device) if case.score_mod else None
        compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        impls["Flex"] = lambda *qkv: compiled(*qkv, score_mod=score_mod, block_mask=block_mask)

    # Each (implementation, mode) timed in rounds of alternating order (attngen.timing); ours under
    # its switches for the whole call, so that the backward runs the same kernels as the forward.
    eager, replays, host = {}, {}, {}
    for name, fn in impls.items():
        if name in checks and not checks[name]["ok"]:
            continue  # not exact: not timed
        switch = switched.get(name, contextlib.nullcontext)
        calls = {
            "fwd": functools.partial(fn, q, k, v),
            "fwd_bwd": lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, dout),
        }
        for mode, call in calls.items():
            eager[name, mode] = functools.partial(switched_time, switch, call)
            if not graphs:
                continue
            with switch():
                call()  # (compiled at these shapes before its host time is taken)
                host[name, f"{mode}_host_us"] = host_time(call, calls=50)
                try:
                    replays[name, f"{mode}_graph"] = functools.partial(median_ms, graphed(call))
                except Exception as e:  # noqa: BLE001  (a call that a CUDA graph cannot capture: not timed so)
                    print(f"  {name} {mode}: no graph ({type(e).__name__}: {str(e).splitlines()[0][:100]})")
    times = {}
    for (name, key), value in {**medians(eager), **medians(replays), **host}.items():
        times.setdefault(name, {})[key] = value
    return {"row": row.label, "case": case.name, "head_dim": head_dim, "seq": seq, "checks": checks, "ms": times}


def ratio(times: dict, mode: str, peer: str) -> str:
    ours = times.get("sm90") or times.get("triton")
    if not ours or mode not in ours or mode not in times.get(peer, {}):
        return "–"
    return f"{times[peer][mode] / ours[mode]:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", default="1024,4096,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--sm90-everywhere", action="store_true", help="build the Hopper kernels for every row")
    parser.add_argument("--graphs", action="store_true", help="also time each call replayed from a CUDA graph")
    args = parser.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    head_dims = [int(d) for d in args.head_dims.split(",")]
    chosen = [c for c in CASES if args.only is None or c.name in args.only.split(",")]
    plan = [(c, d, n) for c in chosen if c.grid for d in head_dims for n in seqs]
    plan += [(c, max(head_dims), min(max(seqs), c.max_seq or max(seqs))) for c in chosen if c.name in MASK_ROWS]
    out_dir = Path(os.environ.get("OUT", "bench-out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cudnn": torch.backends.cudnn.version(),
    }
    for i, (case, head_dim, seq) in enumerate(plan):
        torch._dynamo.reset()
        results.append(run_row(case, head_dim, seq, args.sm90_everywhere, args.graphs))
        print(f"[{i + 1}/{len(plan)}] {results[-1]['row']}: {results[-1]['ms']}", flush=True)
        (out_dir / "results.json").write_text(json.dumps({"environment": env, "rows": results}, indent=1))
    print(f"\n{env}\nms (median), and ours ÷ peer in speed (>1: ours faster); ours = sm90 where it runs")
    print(
        f"{'row':44} {'mode':13} " + " ".join(f"{i:>7}" for i in IMPLS) + "   /split  /triton  /cuDNN    /FA2   /Flex"
    )
    modes = ("fwd", "fwd_bwd", "fwd_graph", "fwd_bwd_graph") if args.graphs else ("fwd", "fwd_bwd")
    for r in results:
        for mode in modes:
            cells = " ".join(f"{r['ms'][i][mode]:7.3f}" if mode in r["ms"].get(i, {}) else f"{'–':>7}" for i in IMPLS)
            ratios = " ".join(f"{ratio(r['ms'], mode, p):>7}" for p in ("split", "triton", "cuDNN", "FA2", "Flex"))
            print(f"{r['row']:44} {mode:13} {cells}  {ratios}")
    if args.graphs:
        print(
            f"\nhost time of an eager call (us; launches queued without waiting)\n{'row':44} {'mode':13} "
            + " ".join(f"{i:>7}" for i in IMPLS)
        )
        for r in results:
            for mode in ("fwd", "fwd_bwd"):
                key = f"{mode}_host_us"
                cells = " ".join(f"{r['ms'][i][key]:7.0f}" if key in r["ms"].get(i, {}) else f"{'–':>7}" for i in IMPLS)
                print(f"{r['row']:44} {mode:13} {cells}")


if __name__ == "__main__":
    main()
