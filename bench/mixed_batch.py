"""Mixed batches on the GPU (vLLM's): decoding sequences and a prefill chunk in one launch.

B sequences decode one token each while one more sequence prefills a chunk of C tokens, every
sequence against a cache of L keys (16-token pages, in random order, as vLLM keeps them), H query
heads over H_kv kv heads, bf16, D = 128, specs/causal.toml. Ours: one `attention_with_kvcache` call
with the tokens packed by `cu_seqlens_q` ("ours ragged"), against the two calls a uniform kernel
needs, one for the decoding sequences and one for the chunk ("ours 2 calls"). Peers, same inputs
on the contiguous cache, two calls each: torch SDPA's FlashAttention-2 and cuDNN backends (without
the causal mask among the chunk's tokens, as bench/decode.py runs them: C << L, the same work).
Each call is first checked against a float64 reference (a decoding sequence and the chunk) by
attngen.exactness's rule; then timed in rounds of alternating order (attngen.timing), eager and
replayed from CUDA graphs. GB/s count the K and V bytes read once per sequence.

    python bench/mixed_batch.py [--lens 8192,32768] [--decoding 32] [--chunk 512]

Prints a table last; writes results.json to $OUT (or ./bench-out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
from decode import _first_line, _sdpa, causal_module, copy_bandwidth, host_time, paged, reference, time_calls
from torch.nn.attention import SDPBackend

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from attngen.exactness import judge

PAGE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lens", default="8192,32768")
    parser.add_argument("--decoding", type=int, default=32, help="sequences decoding one token each")
    parser.add_argument("--chunk", type=int, default=512, help="tokens of the prefill chunk")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    args = parser.parse_args()
    out_dir = Path(os.environ.get("OUT") or "bench-out")
    out_dir.mkdir(parents=True, exist_ok=True)
    spec, module = causal_module("mixed")
    env = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gb_s": copy_bandwidth(),
        "command": "python3 " + " ".join(sys.argv),
    }
    print(env, flush=True)
    generator = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for length in map(int, args.lens.split(",")):
        rows.append(measure(module, args, spec.head_dim, length, generator))
        print(json.dumps(rows[-1]), flush=True)
        (out_dir / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        torch.cuda.empty_cache()

    names = list(rows[0]["impls"])
    print(
        f"\nGB/s of K+V read, eager / replayed from CUDA graphs; {args.decoding} decoding + a {args.chunk}-token chunk"
    )
    print(f"{'L':>7} " + " ".join(f"{n:>20}" for n in names) + "  ragged/2 calls ragged/FA2 ragged/cuDNN")
    for r in rows:
        cells = [
            f"{x['gb_s']:6.0f} / {x.get('graph_gb_s', 0):6.0f}{'' if x['exact'] is not False else '!'}"
            if "gb_s" in x
            else "ERR"
            for x in r["impls"].values()
        ]
        ratios = [_ratio(r["impls"], peer) for peer in ("ours 2 calls", "FA2 2 calls", "cuDNN 2 calls")]
        print(f"{r['len']:7d} " + " ".join(f"{c:>20}" for c in cells) + "  {:>14} {:>10} {:>12}".format(*ratios))
    print("!: not exact by attngen.exactness's rule; ratios of the graph-replayed bandwidth")


def _ratio(impls, peer):
    ours, theirs = impls["ours ragged"], impls[peer]
    key = "graph_gb_s"
    return f"{ours[key] / theirs[key]:.2f}" if key in ours and key in theirs else "–"


def measure(module, args, head_dim, length, generator):
    """One row: the mixed batch at cache length `length`, each implementation checked and timed."""
    B, C, H, Hkv, D = args.decoding, args.chunk, args.heads, args.kv_heads, head_dim
    k, v = (torch.randn(B + 1, Hkv, length, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_pages, v_pages, table = paged(k, v, PAGE, generator)
    lens = torch.full((B + 1,), length, dtype=torch.int32, device="cuda")
    tokens = [1] * B + [C]
    cu = torch.tensor([0, *tokens], device="cuda").cumsum(0).int()
    q = torch.randn(B + C, H, D, device="cuda", dtype=torch.bfloat16)  # packed: the decoding tokens, then the chunk
    q_decoding, q_chunk = q[:B].unsqueeze(2), q[B:].transpose(0, 1)[None]  # [B, H, 1, D], [1, H, C, D]
    workspace = module.kvcache_workspace(q.device)

    def ours_ragged():
        return module.attention_with_kvcache(
            q, k_pages, v_pages, lens, block_table=table, cu_seqlens_q=cu, max_seqlen_q=C, workspace=workspace
        )

    def ours_two_calls():
        first = module.attention_with_kvcache(
            q_decoding, k_pages, v_pages, lens[:B], block_table=table[:B], workspace=workspace
        )
        chunk = module.attention_with_kvcache(
            q_chunk, k_pages, v_pages, lens[B:], block_table=table[B:], workspace=workspace
        )
        return torch.cat([first[:, :, 0], chunk[0].transpose(0, 1)])

    def peer(backend):
        def call():
            first = _sdpa(backend, q_decoding, k[:B], v[:B])
            chunk = _sdpa(backend, q_chunk, k[B:], v[B:])
            return torch.cat([first[:, :, 0], chunk[0].transpose(0, 1)])

        return call

    calls = {
        "ours ragged": ours_ragged,
        "ours 2 calls": ours_two_calls,
        "FA2 2 calls": peer(SDPBackend.FLASH_ATTENTION),
        "cuDNN 2 calls": peer(SDPBackend.CUDNN_ATTENTION),
    }
    # Exactness: the first decoding sequence and the chunk, each against its float64 reference.
    checked = [(slice(0, 1), q[:1].unsqueeze(2), 0), (slice(B, B + C), q_chunk, B)]
    row = {"len": length, "decoding": B, "chunk": C, "heads": H, "kv_heads": Hkv, "impls": {}}
    bytes_read = (B + 1) * Hkv * length * 2 * D * 2
    timed = {}
    for name, fn in calls.items():
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001  (a peer that cannot run this shape)
            row["impls"][name] = {"error": _first_line(e)}
            continue
        verdicts = []
        for rows, q_seq, b in checked:
            exact = reference(q_seq, k[b : b + 1], v[b : b + 1], torch.float64)
            baseline = (reference(q_seq, k[b : b + 1], v[b : b + 1], torch.bfloat16) - exact).abs().max().item()
            err = (out[rows].transpose(0, 1)[None].double() - exact).abs().max().item()
            # The peers leave out the mask among the chunk's tokens: their chunk is not judged.
            if name.startswith("ours") or q_seq.shape[2] == 1:
                verdicts.append(judge("bfloat16", {"out": err}, {"out": baseline}).ok)
        row["impls"][name] = {"exact": all(verdicts), "host_us": host_time(fn)}
        timed[name] = fn
    time_calls(timed, row["impls"], bytes_read)
    return row


if __name__ == "__main__":
    main()
