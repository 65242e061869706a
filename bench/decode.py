"""Decoding from a KV cache on the GPU: exactness, then bandwidth against the peers in one run.

The newest T tokens of each of B sequences (T = 1: decoding; T = 4, 16: speculative tokens)
against a cache of L keys per sequence, H query heads over H_kv kv heads (GQA), bf16, D = 128.
Ours: `attention_with_kvcache` of specs/causal.toml (queries at positions L - T .. L - 1, causal
among themselves), on a contiguous cache and on paged caches (16- and 256-token pages, pages in
random order; also 128-token pages, FlexAttention's), and on an FP8 cache (e4m3 with a factor per
sequence and kv head, vLLM's kv_cache_dtype="fp8": half the bytes; its GB/s count the bf16 bytes it
stands for, so that its column reads as the speed-up). Peers, same inputs: torch SDPA's
FlashAttention-2 and cuDNN backends and compiled FlexAttention, each over the contiguous cache with
`enable_gqa` and no mask (for T > 1 the causal mask among the T new tokens is omitted there: T << L,
the same work), and FlexAttention's paged attention (torch's PagedAttention: 128-token pages, one
per kv block of its block mask, allocated in random order). Ours reuse one workspace
(`kvcache_workspace`), as a serving engine keeps one per stream. Each row is first checked against a
float64 reference by attngen.exactness's rule; then timed with triton.testing.do_bench (median),
each call once a round in turn with the others, the order reversed every other round, the median of
the rounds (attngen.timing). GB/s count the K and V bytes read once (B * H_kv * L * 2 * D * 2 bytes)
per call; % peak is against a device-to-device copy measured in the same run. Each call is also
replayed from a CUDA graph, as serving engines run decoding (host time gone: it dominates short
caches), beside a graph-replayed copy that moves the same bytes (what HBM gives a transfer that
short), and its host time per eager call is reported.

    python bench/decode.py [--lens 1024,8192,32768,131072] [--tokens 1,4,16] [--batch 8]

Prints a table last; writes results.json to $OUT (or ./bench-out).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention
from torch.nn.functional import scaled_dot_product_attention as sdpa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from attngen.build import import_generated, write_package
from attngen.exactness import judge
from attngen.spec import load_spec
from attngen.timing import median_ms, medians


def causal_module(bench: str):
    """(spec, its Triton module) of specs/causal.toml, built afresh for `bench` in a scratch folder."""
    spec = load_spec(ROOT / "specs" / "causal.toml")
    scratch = Path(tempfile.mkdtemp(prefix=f"attngen-{bench}-"))
    write_package(spec, scratch)
    return spec, import_generated(scratch / spec.name / "triton_gpu.py", f"attngen_{bench}_causal")


def copy_bandwidth(moved: int = 2**33, graph: bool = False) -> float:
    """GB/s of a device-to-device copy that moves `moved` bytes (half read, half written): by default
    a 4 GiB copy, the HBM peak we measure against. With a row's K and V bytes, replayed from a CUDA
    graph as our calls are: what HBM gives a transfer that short (it pays the launch and the ramp)."""
    source = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    copy = lambda: target.copy_(source)
    return moved / median_ms(graphed(copy) if graph else copy) / 1e6


def paged(k: torch.Tensor, v: torch.Tensor, page_size: int, generator):
    """The contiguous caches [B, H_kv, L, D] as pages [B * L / page_size, H_kv, page_size, D] in one
    random order, and the block table [B, L / page_size] that reads them back: (k pages, v pages, table)."""
    batch, kv_heads, length, dim = k.shape
    per_sequence = length // page_size
    order = torch.randperm(batch * per_sequence, generator=generator, device="cpu").to(k.device)

    def pages_of(cache):
        pages = cache.reshape(batch, kv_heads, per_sequence, page_size, dim).permute(0, 2, 1, 3, 4)
        out = torch.empty_like(pages.reshape(batch * per_sequence, kv_heads, page_size, dim))
        out[order] = pages.reshape(batch * per_sequence, kv_heads, page_size, dim)
        return out

    return pages_of(k), pages_of(v), order.view(batch, per_sequence).int()


def fp8_cache(k, v):
    """The caches in FP8 as vLLM keeps them: e4m3 with a factor per sequence and kv head (its largest
    magnitude / 448). Returns ((k8, v8, k_descale, v_descale), k's true values, v's), the true values
    (e4m3 times factor) in float32."""
    cached, true = [], []
    for cache in (k, v):
        factor = cache.float().abs().amax(dim=(2, 3)).clamp_min(1e-12) / 448
        e4m3 = (cache.float() / factor[:, :, None, None]).to(torch.float8_e4m3fn)
        cached.append((e4m3, factor))
        true.append(e4m3.float() * factor[:, :, None, None])
    (k8, k_descale), (v8, v_descale) = cached
    return (k8, v8, k_descale, v_descale), *true


def reference(q, k, v, dtype):
    """Attention of the T new tokens (bottom-right causal) over the cache, in `dtype` (float64: the
    oracle; the inputs' dtype: the same-precision baseline, probabilities rounded as a kernel does)."""
    heads, kv_heads, new_tokens, length = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    scores = (q.to(dtype) @ k.to(dtype).transpose(-1, -2)).to(accumulate) / math.sqrt(q.shape[-1])
    position = torch.arange(length - new_tokens, length, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(length, device=q.device)[None, :] > position, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(dtype)
    return (probs @ v.to(dtype)).to(accumulate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lens", default="1024,8192,32768,131072")
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT") or "bench-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    spec, module = causal_module("decode")
    flex = torch.compile(flex_attention)
    peak = copy_bandwidth()
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gb_s": peak,
        "command": "python3 " + " ".join(sys.argv),
    }
    print(env, flush=True)
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for length in map(int, args.lens.split(",")):
        for row in measure(module, flex, args, spec.head_dim, length, generator):
            rows.append(row)
            print(json.dumps(row), flush=True)
            (out_dir / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        torch.cuda.empty_cache()

    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, spec.head_dim
    names = list(rows[0]["impls"])
    print(f"\nGB/s of K+V read (% of the {peak:.0f} GB/s copy); B={B}, H={H}, H_kv={Hkv}, D={D}, bf16")
    print(
        f"{'L':>7} {'T':>3} "
        + " ".join(f"{n:>16}" for n in names)
        + "  ours/FA2 ours/cuDNN ours/Flex paged/Flex-paged fp8/ours"
    )
    for r in rows:
        cells = []
        for n in names:
            x = r["impls"][n]
            cells.append(
                f"{x['gb_s']:6.0f} ({100 * x['gb_s'] / peak:3.0f}%){'' if x['exact'] is not False else '!'}"
                if "gb_s" in x
                else f"{'ERR':>16}"
            )
        ratios = [_ratio(r["impls"], "ours", peer) for peer in ("FA2", "cuDNN", "Flex")]
        ratios.append(_ratio(r["impls"], f"ours paged {FLEX_PAGE}", f"Flex paged {FLEX_PAGE}"))
        ratios.append(_ratio(r["impls"], "ours fp8", "ours"))
        print(
            f"{r['len']:7d} {r['new_tokens']:3d} "
            + " ".join(f"{c:>16}" for c in cells)
            + "  {:>8} {:>10} {:>9} {:>17} {:>8}".format(*ratios)
        )
    print("!: not exact by attngen.exactness's rule")
    graph_names = ["ours", "ours paged 16", "ours fp8", "FA2", "cuDNN"]
    print("\nReplayed from CUDA graphs (GB/s; host time per eager call in us in brackets; the last column:")
    print("ours against a graph-replayed copy moving the same bytes)")
    print(f"{'L':>7} {'T':>3} " + " ".join(f"{n:>18}" for n in graph_names) + "  ours/FA2 ours/cuDNN ours/copy")
    for r in rows:
        measured = r["impls"]
        cells = [
            f"{measured[n]['graph_gb_s']:6.0f} ({measured[n]['host_us']:4.0f} us)"
            if "graph_gb_s" in measured[n]
            else "–"
            for n in graph_names
        ]
        ratios = [_ratio(measured, "ours", peer, "graph_gb_s") for peer in ("FA2", "cuDNN")]
        ours = measured["ours"].get("graph_gb_s")
        ratios.append(f"{ours / r['same_size_copy_gb_s']:.2f}" if ours else "–")
        print(
            f"{r['len']:7d} {r['new_tokens']:3d} "
            + " ".join(f"{c:>18}" for c in cells)
            + "  {:>8} {:>10} {:>9}".format(*ratios)
        )


def _ratio(impls, name, peer, key="gb_s"):
    ours, theirs = impls[name], impls[peer]
    return f"{ours[key] / theirs[key]:.2f}" if key in ours and key in theirs else "–"


def impls(module, flex, q, k, v, lens, pages, flex_paged, fp8):
    """Each implementation's call on the same inputs (fp8: the FP8 caches and their factors)."""

    workspace = module.kvcache_workspace(q.device)  # one for every call: they run one at a time
    k8, v8, k_descale, v_descale = fp8

    def paged_call(size):
        k_pages, v_pages, table = pages[size]
        return lambda: module.attention_with_kvcache(q, k_pages, v_pages, lens, block_table=table, workspace=workspace)

    return {
        "ours": lambda: module.attention_with_kvcache(q, k, v, lens, workspace=workspace),
        "ours fp8": lambda: module.attention_with_kvcache(
            q, k8, v8, lens, k_descale=k_descale, v_descale=v_descale, workspace=workspace
        ),
        "ours paged 16": paged_call(16),
        "ours paged 128": paged_call(FLEX_PAGE),
        "ours paged 256": paged_call(256),
        "FA2": lambda: _sdpa(SDPBackend.FLASH_ATTENTION, q, k, v),
        "cuDNN": lambda: _sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v),
        "Flex": lambda: flex(q, k, v, enable_gqa=True),
        "Flex paged 128": flex_paged(q),
    }


# FlexAttention's paged attention maps its block mask's kv blocks onto pages: a page is one kv block.
FLEX_PAGE = 128


def flex_paged_attention(flex, k, v, generator):
    """FlexAttention's paged attention (torch.nn.attention.experimental's PagedAttention) over the same
    K/V, pages allocated in a random order: a function of q giving the call to time."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask

    batch, kv_heads, length, dim = k.shape
    n_pages = batch * length // FLEX_PAGE
    paging = PagedAttention(n_pages, FLEX_PAGE, batch, device="cuda")
    paging.empty_pages = torch.randperm(n_pages, generator=generator).tolist()
    for b in range(batch):
        paging.reserve(torch.tensor(b, device="cuda"), torch.tensor(length, device="cuda"))
    k_cache, v_cache = (
        torch.empty(1, kv_heads, n_pages * FLEX_PAGE, dim, device="cuda", dtype=k.dtype) for _ in range(2)
    )
    positions = torch.arange(length, device="cuda").expand(batch, length)
    paging.assign(torch.arange(batch, device="cuda"), positions, k, v, k_cache, v_cache)

    def call(q):
        logical = create_block_mask(
            lambda b, h, q_idx, kv_idx: kv_idx >= 0,
            batch,
            None,
            q.shape[2],
            length,
            device="cuda",
            BLOCK_SIZE=FLEX_PAGE,
        )
        mask = paging.convert_logical_block_mask(logical)
        return lambda: flex(q, k_cache, v_cache, block_mask=mask, enable_gqa=True)

    return call


def measure(module, flex, args, head_dim, length, generator):
    """The rows of one cache length: each number of new tokens, each implementation."""
    B, H, Hkv, D = args.batch, args.heads, args.kv_heads, head_dim
    k, v = (torch.randn(B, Hkv, length, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pages = {size: paged(k, v, size, generator) for size in (16, FLEX_PAGE, 256)}
    fp8, k_fp8, v_fp8 = fp8_cache(k, v)
    flex_paged = flex_paged_attention(flex, k, v, generator)
    lens = torch.full((B,), length, dtype=torch.int32, device="cuda")
    bytes_read = B * Hkv * length * 2 * D * 2
    same_size_copy = copy_bandwidth(bytes_read, graph=True)
    for new_tokens in map(int, args.tokens.split(",")):
        q = torch.randn(B, H, new_tokens, D, device="cuda", dtype=torch.bfloat16)
        # Exactness on the first two sequences (the float64 reference materialises the scores).
        exact = reference(q[:2], k[:2], v[:2], torch.float64)
        baseline = (reference(q[:2], k[:2], v[:2], torch.bfloat16) - exact).abs().max().item()
        # The FP8 cache's true values: e4m3 times their factors.
        exact_fp8 = reference(q[:2], k_fp8[:2], v_fp8[:2], torch.float64)
        baseline_fp8 = (reference(q[:2], k_fp8[:2], v_fp8[:2], torch.bfloat16) - exact_fp8).abs().max().item()
        row = {"len": length, "new_tokens": new_tokens, "batch": B, "heads": H, "kv_heads": Hkv, "impls": {},
               "same_size_copy_gb_s": same_size_copy}  # fmt: skip
        calls = {}
        for name, fn in impls(module, flex, q, k, v, lens, pages, flex_paged, fp8).items():
            try:
                out = fn()
            except Exception as e:  # noqa: BLE001  (a peer that cannot run this shape)
                row["impls"][name] = {"error": _first_line(e)}
                continue
            want, base = (exact_fp8, baseline_fp8) if name == "ours fp8" else (exact, baseline)
            err = (out[:2].double() - want).abs().max().item()
            # Peers run without the mask among the T new tokens: judged only at T = 1.
            judged = name.startswith("ours") or new_tokens == 1
            ok = judge("bfloat16", {"out": err}, {"out": base}).ok if judged else None
            row["impls"][name] = {"error": err, "exact": ok, "host_us": host_time(fn)}
            calls[name] = fn
        time_calls(calls, row["impls"], bytes_read)
        yield row


def time_calls(calls, results, bytes_read):
    """Each call timed in rounds of alternating order (attngen.timing), eager and replayed from a CUDA
    graph, into results[name]: ms, gb_s and graph_gb_s (bytes_read a call); a failure, noted there."""

    def failed(name, e, key):
        results[name][key] = _first_line(e)

    eager = {name: functools.partial(median_ms, fn) for name, fn in calls.items()}
    for name, ms in medians(eager, failed=functools.partial(failed, key="timing_error")).items():
        results[name].update(ms=ms, gb_s=bytes_read / ms / 1e6)
    replays = {}
    for name, fn in calls.items():
        try:
            replays[name] = functools.partial(median_ms, graphed(fn))
        except Exception as e:  # noqa: BLE001  (a call that a CUDA graph cannot capture)
            failed(name, e, "graph_error")
    for name, ms in medians(replays, failed=functools.partial(failed, key="graph_error")).items():
        results[name]["graph_gb_s"] = bytes_read / ms / 1e6


def _first_line(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def host_time(fn, calls: int = 200) -> float:
    """Microseconds of host time per call, launches queued without waiting (the GPU's queue is
    deeper than the calls made)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def graphed(fn):
    """fn captured in a CUDA graph (as serving engines run decoding): its replay, host time gone."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _sdpa(backend, q, k, v):
    with sdpa_kernel(backend):
        return sdpa(q, k, v, enable_gqa=True)


if __name__ == "__main__":
    main()
