"""Run the generated Triton kernels of specs/ at real sizes on a GPU: exactness, then rough speed.

For every spec in specs/ and dtype in (float16, bfloat16), with the tests' params for it
(attngen.testing.example_params: fresh random tensors at this shape): build the package, run forward
and backward on fresh random inputs, compare out, lse, dq, dk, dv with the float64 oracle (torch
float64 on the GPU, attngen.reference) and with torch SDPA in the same precision -- the
FlashAttention rule of attngen.exactness: our error <= 2x SDPA's error + a small floor. SDPA has flash kernels only for
causal and full attention; for the other specs the same-precision baseline is the reference run
in that dtype. Then
time forward and forward+backward of ours and SDPA (triton.testing.do_bench, median), and show
torch._dynamo.explain for a transformer block calling the op. Prints a table last; writes JSON
to $OUT.

    python bench/h200_exactness.py [--batch 2 --heads 8 --seq 4096] [--specs causal,document]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from attngen.build import import_generated, write_package
from attngen.exactness import judge
from attngen.reference import attention_ref_torch, evaluate, positions
from attngen.spec import load_spec, parse_spec
from attngen.testing import example_params

# Cases that once failed at real sizes, with their own shapes: (spec text, q_len, kv_len).
# fp16 rows whose first tiles see no key, then only far keys under a distance penalty (P falls
# into fp16's subnormals if the row's running max is kept at 0 instead of -inf).
REGRESSIONS = {
    f"penalised_window_d{head_dim}": (
        (
            f'name = "penalised_window_d{head_dim}"\nhead_dim = {head_dim}\ndtype = "float16"\n'
            '[mask]\nexpr = "kv_idx <= q_idx + 3 and q_idx - kv_idx < 300"\n'
            '[score]\nexpr = "score - 0.05 * abs(q_idx - kv_idx)"\n'
        ),
        3001,
        2049,
    )
    for head_dim in (64, 128)
}


def load_kernel(spec, out_dir: Path):
    write_package(spec, out_dir)
    return import_generated(out_dir / spec.name / "triton_gpu.py", f"{spec.name}_{spec.dtype}_triton")


def visible_mask(spec, B, H, Nq, Nk, params, device):
    if spec.mask is None:
        return None
    return evaluate(spec.mask, {**positions(B, H, Nq, Nk, torch, device=device), **params}, torch).expand(B, H, Nq, Nk)


def same_precision_peer(spec, visible, grouped: bool):
    """(name, fn(q, k, v) -> out) for the framework implementation in the kernel's dtype (grouped:
    k and v have fewer heads than q)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if spec.score is not None or grouped:
        return "reference in dtype", lambda q, k, v, **params: attention_ref_torch(
            spec, q, k, v, dtype=q.dtype, **params
        )[0]
    if spec.mask_source == "q_idx >= kv_idx":
        return "SDPA causal", lambda q, k, v, **params: sdpa(q, k, v, is_causal=True)
    if visible is None:
        return "SDPA", lambda q, k, v, **params: sdpa(q, k, v)
    # SDPA takes other masks only densely, in kernels that keep P in float32 (more precise than any
    # flash kernel, which rounds P to the dtype for P @ V): the FlashAttention rule's baseline is
    # the plain implementation in the dtype.
    return "reference in dtype", lambda q, k, v, **params: attention_ref_torch(spec, q, k, v, dtype=q.dtype, **params)[
        0
    ]


def max_err(a, b):
    return float((a.double() - b.double()).abs().max())


def explain_block(module, params, device, dtype):
    heads, head_dim = 4, module.HEAD_DIM
    qkv = torch.nn.Linear(256, 3 * heads * head_dim, device=device, dtype=dtype)
    proj = torch.nn.Linear(heads * head_dim, 256, device=device, dtype=dtype)

    def block(x):
        batch, seq, _ = x.shape
        q, k, v = qkv(x).reshape(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
        return x + proj(module.attention(q, k, v, **params).transpose(1, 2).reshape(batch, seq, heads * head_dim))

    explanation = torch._dynamo.explain(block)(torch.randn(2, 512, 256, device=device, dtype=dtype))
    return explanation.graph_count, explanation.graph_break_count, str(explanation).splitlines()[:6]


def check(spec, build_dir: Path, args, device, q_len=None, kv_len=None) -> dict:
    """Exactness (forward and backward) and timings of one spec in one dtype (q_len x kv_len:
    --seq x --seq unless given)."""
    dtype = spec.dtype
    t0 = time.perf_counter()
    module = load_kernel(spec, build_dir)
    B, H, D = args.batch, args.heads, spec.head_dim
    Nq, Nk = q_len or args.seq, kv_len or args.seq
    # The tests' params for each spec of specs/ (fresh random tensors at this shape), on the GPU.
    params = {
        name: torch.as_tensor(value, device=device) if hasattr(value, "shape") else value
        for name, value in example_params(spec.name, B, H, Nq, Nk, seed=int.from_bytes(os.urandom(4), "little")).items()
    }
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    Dv = spec.value_dim  # v's and the output's head dim
    Hkv = args.kv_heads or H  # fewer: grouped-query attention
    shapes = ((B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, Dv), (B, H, Nq, Dv))
    q, k, v, dout = (torch.randn(shape, device=device, dtype=getattr(torch, dtype)) for shape in shapes)
    dlse = torch.randn(B, H, Nq, device=device)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = module.attention(*leaves, return_lse=True, **params)
    grads = torch.autograd.grad([out, lse], leaves, [dout, dlse])
    torch.cuda.synchronize()
    first_call_s = time.perf_counter() - t0

    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = attention_ref_torch(spec, *ref_leaves, **params)
    ref_grads = torch.autograd.grad([ref_out, ref_lse], ref_leaves, [dout.double(), dlse.double()])
    finite = torch.isfinite(ref_lse)
    errors = {
        "out": max_err(out, ref_out),
        "lse": max_err(lse[finite], ref_lse[finite]),
        **{name: max_err(g, r) for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads)},
    }

    visible = visible_mask(spec, B, H, Nq, Nk, params, device)
    peer_name, peer = same_precision_peer(spec, visible, grouped=Hkv != H)
    peer_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    peer_out = peer(*peer_leaves, **params)
    peer_grads = torch.autograd.grad(peer_out, peer_leaves, dout)
    # The peer's gradients get no dlse: compare ours with dlse = 0 against them.
    ours_no_lse = torch.autograd.grad(module.attention(*leaves, **params), leaves, dout)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out = attention_ref_torch(spec, *ref_leaves, **params)[0]
    ref_grads_no_lse = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    peer_errors = {"out": max_err(peer_out, ref_out)}
    ours_vs_rule = {"out": errors["out"]}
    magnitude = {"out": float(ref_out.abs().max())}
    for name, ours_g, peer_g, ref_g in zip(("dq", "dk", "dv"), ours_no_lse, peer_grads, ref_grads_no_lse):
        peer_errors[name] = max_err(peer_g, ref_g)
        ours_vs_rule[name] = max_err(ours_g, ref_g)
        magnitude[name] = float(ref_g.abs().max())
    magnitude["lse"] = float(ref_lse[finite].abs().max()) if finite.any() else 0.0
    # attngen.exactness's rule: out and gradients (without dlse) against the peer, LSE on its own.
    verdict = judge(dtype, {**ours_vs_rule, "lse": errors["lse"]}, peer_errors, magnitude)
    exact = verdict.ok

    density = float(visible.float().mean()) if visible is not None else 1.0
    flops = 2 * B * H * Nq * Nk * (D + Dv) * density  # q.k and p.v

    def ours_fwd():
        return module.attention(q, k, v, **params)

    def ours_fwd_bwd():
        out = module.attention(*leaves, **params)
        return torch.autograd.grad(out, leaves, dout)

    def peer_fwd():
        return peer(q, k, v, **params)

    def peer_fwd_bwd():
        return torch.autograd.grad(peer(*peer_leaves, **params), peer_leaves, dout)

    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    ms = {"fwd": bench(ours_fwd), "fwd_bwd": bench(ours_fwd_bwd)}
    peer_ms = {"fwd": bench(peer_fwd), "fwd_bwd": bench(peer_fwd_bwd)}
    row = {
        "spec": spec.name,
        "dtype": dtype,
        "shape": [B, H, Nq, D] if Nq == Nk else [B, H, Nq, Nk, D],
        "kv_heads": Hkv,
        "params": {name: f"tensor{list(v.shape)}" if isinstance(v, torch.Tensor) else v for name, v in params.items()},
        "mask_density": density,
        "first_call_s": first_call_s,
        "errors_vs_float64": errors,
        "errors_without_dlse": ours_vs_rule,
        "peer": peer_name,
        "peer_errors_vs_float64": peer_errors,
        "exact": bool(exact),
        "allowed": verdict.allowed,
        "verdict": verdict.message,
        "ms": ms,
        "peer_ms": peer_ms,
        "tflops_fwd": flops / ms["fwd"] * 1e-9,
        "tflops_fwd_bwd": 3.5 * flops / ms["fwd_bwd"] * 1e-9,
        "peer_tflops_fwd": flops / peer_ms["fwd"] * 1e-9,
        "peer_tflops_fwd_bwd": 3.5 * flops / peer_ms["fwd_bwd"] * 1e-9,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--specs", help="comma-separated spec names (default: every spec of specs/)")
    parser.add_argument("--kv-heads", type=int, help="kv heads, dividing --heads (GQA/MQA; default: --heads)")
    args = parser.parse_args()
    out_root = Path(os.environ.get("OUT", tempfile.mkdtemp()))
    build_root = Path(tempfile.mkdtemp(prefix="attngen-gpu-"))
    device = torch.device("cuda")
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)

    rows = []
    for spec_file in sorted((ROOT / "specs").glob("*.toml")):
        if args.specs and spec_file.stem not in args.specs.split(","):
            continue
        base = load_spec(spec_file)
        for dtype in ("float16", "bfloat16"):
            digest = hashlib.sha256(f"{base.sha256}:{dtype}".encode()).hexdigest()
            spec = dataclasses.replace(base, dtype=dtype, sha256=digest)
            row = check(spec, build_root / dtype, args, device)
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()

    for name, (text, q_len, kv_len) in REGRESSIONS.items():
        if args.specs and name not in args.specs.split(","):
            continue
        row = check(parse_spec(text, f"<{name}>"), build_root / "regressions", args, device, q_len, kv_len)
        rows.append(row)
        print(json.dumps(row), flush=True)

    causal = load_kernel(dataclasses.replace(load_spec(ROOT / "specs/causal.toml")), build_root / "explain")
    graphs, breaks, text = explain_block(causal, {}, device, torch.bfloat16)
    print("torch._dynamo.explain, transformer block calling generated/causal:", *text, sep="\n  ")

    (out_root / "h200_exactness.json").write_text(json.dumps({"rows": rows, "dynamo_explain": text}, indent=2))
    print(
        f"\n{'spec':15} {'dtype':8} {'out err':>8} {'dq err':>8} {'dk err':>8} {'dv err':>8} {'peer dq':>8} {'exact':>5} "
        f"{'fwd TF':>6} {'peer':>5} {'f+b TF':>6} {'peer':>5} {'1st':>5}  peer"
    )
    for r in rows:
        e, pe = r["errors_without_dlse"], r["peer_errors_vs_float64"]
        print(
            f"{r['spec']:15} {r['dtype']:8} {e['out']:8.1e} {e['dq']:8.1e} {e['dk']:8.1e} {e['dv']:8.1e} {pe['dq']:8.1e} "
            f"{r['exact']!s:>5} {r['tflops_fwd']:6.0f} {r['peer_tflops_fwd']:5.0f} {r['tflops_fwd_bwd']:6.0f} "
            f"{r['peer_tflops_fwd_bwd']:5.0f} {r['first_call_s']:4.1f}s  {r['peer']}"
        )
    print(f"dynamo: {graphs} graph(s), {breaks} graph break(s)")
    if not all(r["exact"] for r in rows) or breaks:
        sys.exit(1)


if __name__ == "__main__":
    main()
