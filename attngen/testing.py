"""Helpers shared by the tests (tests/) and the GPU bench scripts (bench/).

Input: a spec name of specs/ and a problem shape. Output: runtime params for that spec at that
shape (`example_params`, with the varlen recipe `varlen_params`). The exactness rule itself lives
in attngen.exactness; Triton's interpreter bf16 bug is fixed by each generated bf16 module itself
(templates/triton_gpu/interpreter_bf16.py.jinja).
"""

from __future__ import annotations

import numpy as np


def example_params(spec_name: str, batch: int, heads: int, q_len: int, kv_len: int, seed: int = 0) -> dict:
    """Runtime params for a spec of specs/ at this shape: fixed scalars, fresh random tensors.

    Args:
        spec_name: The spec's name (its file name in specs/ without .toml).
        batch: Batch size.
        heads: Query heads.
        q_len: Query length.
        kv_len: Key length.
        seed: Seed of the random tensors.

    Returns:
        {param name: value}, numpy arrays for tensors; {} for a spec without params.
    """
    rng = np.random.default_rng(seed)
    examples = {
        "alibi": lambda: {"num_heads": heads},
        "local_window": lambda: {"left": 50, "right": 20},
        "sliding_window": lambda: {"window": 70},
        "prefix_lm": lambda: {"prefix": 45},
        "softcap": lambda: {"softcap": 20.0},
        "strided": lambda: {"stride": 24},
        "chunked": lambda: {"chunk": 100},
        "alibi_slopes": lambda: {"slopes": rng.uniform(0.01, 0.5, heads).astype(np.float32)},
        # 33 buckets for distances -16..16: longer distances clamp to the table's ends.
        "relative_bias": lambda: {"rel_bias": rng.standard_normal((heads, 33)).astype(np.float32), "max_dist": 16},
        "bias": lambda: {"bias": rng.standard_normal((batch, heads, q_len, kv_len)).astype(np.float32)},
        # Scores are about standard normal: a few keys of each row pass their sequence's bound.
        "score_cutoff": lambda: {"bound": rng.uniform(2.0, 3.0, batch).astype(np.float32)},
        # Sinks of a few units either way: some rows give the sink most of their weight.
        "sinks": lambda: {"sinks": 2 * rng.standard_normal(heads).astype(np.float32)},
        # Some prefixes are negative or past the keys: all-causal and all-visible rows.
        "prefix_lm_batched": lambda: {"prefix": rng.integers(-5, kv_len + 5, batch).astype(np.int32)},
        "varlen": lambda: {  # each sequence of the batch packed its own way
            name: np.concatenate(rows)
            for name, *rows in zip(
                ("seq_q", "seq_kv", "pos_q", "pos_kv"),
                *(varlen_params(*random_cu_seqlens(rng, q_len, kv_len)).values() for _ in range(batch)),
            )
        },
        # Five draft tokens in a random tree each sequence (a parent before its child): ancestors and self.
        "tree_verify": lambda: {"tree": np.stack([draft_tree(rng, 5) for _ in range(batch)]), "drafts": 5},
        # Sorted ids: packed documents of random lengths (a query may start a document its keys lack).
        "document": lambda: {
            "seg_q": np.sort(rng.integers(0, 4, (batch, q_len)), axis=1).astype(np.int32),
            "seg_kv": np.sort(rng.integers(0, 4, (batch, kv_len)), axis=1).astype(np.int32),
        },
    }
    return examples[spec_name]() if spec_name in examples else {}


def draft_tree(rng, drafts: int) -> np.ndarray:
    """A random tree of draft tokens (speculative decoding) as specs/tree_verify.toml's `tree`.

    Args:
        rng: A numpy Generator.
        drafts: Number of draft tokens; token i's parent is one of tokens 0 .. i - 1 (0 is the root).

    Returns:
        [drafts, drafts] bool: [i, j] whether draft j is i or one of its ancestors.
    """
    tree = np.eye(drafts, dtype=bool)
    for i in range(1, drafts):
        tree[i] |= tree[rng.integers(0, i)]
    return tree


def random_cu_seqlens(rng, q_len: int, kv_len: int, count: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative lengths of `count` packed sequences of random lengths (some empty).

    Args:
        rng: A numpy Generator.
        q_len: Total query length.
        kv_len: Total key length.
        count: Number of sequences.

    Returns:
        ([0, ..., q_len], [0, ..., kv_len]) as flash_attn_varlen_func takes them, int32.
    """
    cuts = lambda n: np.sort(np.concatenate([[0, n], rng.integers(0, n + 1, count - 1)]))
    return cuts(q_len).astype(np.int32), cuts(kv_len).astype(np.int32)


def varlen_params(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray) -> dict:
    """specs/varlen.toml's tensors from cumulative lengths (the README's recipe, in numpy).

    Args:
        cu_seqlens_q: [0, ..., q_len] cumulative query lengths.
        cu_seqlens_k: [0, ..., kv_len] cumulative key lengths.

    Returns:
        seq_q, seq_kv (each token's sequence) and pos_q, pos_kv (its position there, queries shifted
        to align the diagonals bottom-right), each [1, length] int32.
    """
    lens_q, lens_k = np.diff(cu_seqlens_q), np.diff(cu_seqlens_k)
    seq_q = np.repeat(np.arange(len(lens_q)), lens_q)
    seq_kv = np.repeat(np.arange(len(lens_k)), lens_k)
    pos_q = np.arange(cu_seqlens_q[-1]) - cu_seqlens_q[seq_q] + (lens_k - lens_q)[seq_q]
    pos_kv = np.arange(cu_seqlens_k[-1]) - cu_seqlens_k[seq_kv]
    return {
        name: x[None].astype(np.int32)
        for name, x in zip(("seq_q", "seq_kv", "pos_q", "pos_kv"), (seq_q, seq_kv, pos_q, pos_kv))
    }


def fp8_quantized(x, kv_heads: int, per_head: bool = True):
    """x as attention_fp8 takes it: e4m3 values and their descale, FlashAttention-3's recipe.

    Args:
        x: [batch, heads, seq, head_dim] float torch tensor (q, k or v).
        kv_heads: The problem's kv heads: one descale per batch and kv head (q's query heads of one
            kv head share theirs).
        per_head: One descale per [batch, kv_head] (else one for the tensor).

    Returns:
        (x8 torch.float8_e4m3fn, descale float32 [batch, kv_heads] (or [] per tensor), the true
        values x8 * descale in float32): amax / 448 maps each group's largest value to e4m3's.
    """
    import torch

    batch, heads = x.shape[:2]
    groups = x.float().reshape(batch, kv_heads, -1).abs()
    amax = groups.amax(-1) if per_head else groups.amax()
    descale = amax.clamp_min(1e-30) / 448.0
    expanded = (descale.repeat_interleave(heads // kv_heads, 1) if per_head else descale.expand(batch, heads))[
        ..., None, None
    ]
    x8 = (x.float() / expanded).to(torch.float8_e4m3fn)
    return x8, descale, x8.float() * expanded
