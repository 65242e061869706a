"""attention_with_kvcache (the decode family): the newest tokens of each sequence against its KV
cache, contiguous or paged, split over programs or not, with grouped query heads, against the
float64 reference of attention over the whole sequence (its last rows) -- Triton interpreter."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen.exactness import check_forward, judge, lowp_baseline, max_error, round_to
from attngen.reference import attention_ref
from attngen.spec import load_spec, retarget
from attngen.testing import example_params
from tests import harness

# Specs whose params make sense at any cache position (varlen packs several sequences in one row).
SPECS = [
    "causal",
    "full",
    "sliding_window",
    "local_window",
    "chunked",
    "prefix_lm_batched",
    "alibi_slopes",
    "softcap",
    "relative_bias",
    "bias",
    "document",
    "causal_bottom_right",
    "value_dim",
]


@st.composite
def problems(draw):
    kv_heads = draw(st.integers(1, 2))
    new_tokens = draw(st.integers(1, 5))
    batch = draw(st.integers(1, 3))
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from([16, 32, 64])) if paged else None
    capacity = draw(st.sampled_from([64, 128, 192])) if paged else draw(st.integers(new_tokens, 200))
    return {
        "dtype": draw(st.sampled_from(["float32", "float16", "bfloat16"])),
        "batch": batch,
        "kv_heads": kv_heads,
        "heads": kv_heads * draw(st.sampled_from([1, 2, 4])),
        "new_tokens": new_tokens,
        "capacity": capacity,
        "page_size": page_size,
        "seqlens": draw(st.lists(st.integers(new_tokens, capacity), min_size=batch, max_size=batch)),
        "num_splits": draw(st.sampled_from([None, 1, 2, 3])),
        "seed": draw(st.integers(0, 2**31)),
    }


def _as_cache(rows, table, num_pages, page_size):
    """Each sequence's rows [batch, kv_heads, capacity, dim] as the kernel takes them: the same array
    (contiguous), or pages [num_pages, kv_heads, page_size, dim] under the block table; pages no
    sequence uses hold NaN, so reading one cannot go unnoticed."""
    if table is None:
        return torch.from_numpy(rows)
    pages = np.full((num_pages, rows.shape[1], page_size, rows.shape[3]), np.nan, np.float32)
    for b, sequence_pages in enumerate(table):
        for j, page in enumerate(sequence_pages):
            pages[page] = rows[b, :, j * page_size : (j + 1) * page_size]
    return torch.from_numpy(pages)


def _sequence_params(params, spec, b, length):
    """The params of sequence b at its length: batch axes at b, q_len and kv_len axes cut to it."""
    out = {}
    for p in spec.params:
        value = params[p.name]
        if p.is_tensor:
            index = tuple(
                slice(b, b + 1) if axis == "batch" else slice(0, length) if axis in ("q_len", "kv_len") else slice(None)
                for axis in p.shape
            )
            value = value[index]
        out[p.name] = value
    return out


def check(spec_name: str, p: dict):
    torch_dtype = getattr(torch, p["dtype"])
    base = load_spec(f"specs/{spec_name}.toml")
    spec = retarget(base, 32 if base.head_dim_v is None else base.head_dim, p["dtype"])
    if p["dtype"] == "bfloat16":
        harness.fix_interpreter_bf16_dot()
    module = harness.load_target(spec, "triton_gpu")
    rng = np.random.default_rng(p["seed"])
    B, H, T, cap, kv_heads = p["batch"], p["heads"], p["new_tokens"], p["capacity"], p["kv_heads"]
    draw = lambda *shape: round_to(rng.standard_normal(shape).astype(np.float32), p["dtype"])
    q = draw(B, H, T, spec.head_dim)
    k_rows, v_rows = draw(B, kv_heads, cap, spec.head_dim), draw(B, kv_heads, cap, spec.value_dim)
    table, num_pages = None, 0
    if p["page_size"] is not None:
        pages_per_sequence = cap // p["page_size"]
        num_pages = B * pages_per_sequence + 3  # a few pages no sequence uses
        table = rng.permutation(num_pages)[: B * pages_per_sequence].reshape(B, pages_per_sequence)
    k_cache, v_cache = (_as_cache(rows, table, num_pages, p["page_size"]) for rows in (k_rows, v_rows))
    params = example_params(spec_name, B, H, cap, cap, seed=p["seed"])
    seqlens = torch.tensor(p["seqlens"], dtype=torch.int32)
    out, lse = module.attention_with_kvcache(
        torch.from_numpy(q).to(torch_dtype),
        k_cache.to(torch_dtype),
        v_cache.to(torch_dtype),
        seqlens,
        block_table=None if table is None else torch.from_numpy(table.astype(np.int32)),
        return_lse=True,
        num_splits=p["num_splits"],
        **harness.params_as(params, torch.as_tensor),
    )
    # The new rows of every sequence, judged at once. The same-precision baseline's error is taken
    # over every row of the sequences: a handful of new rows is too few for a steady maximum.
    refs, ref_lses, baseline_error = [], [], 0.0
    for b, length in enumerate(p["seqlens"]):
        # The whole sequence: earlier queries drawn afresh, the new tokens last.
        q_seq = draw(1, H, length, spec.head_dim)
        q_seq[:, :, length - T :] = q[b]
        k_seq, v_seq = k_rows[b : b + 1, :, :length], v_rows[b : b + 1, :, :length]
        seq_params = _sequence_params(params, spec, b, length)
        ref_out, ref_lse = attention_ref(spec, q_seq, k_seq, v_seq, **seq_params)
        refs.append(ref_out[:, :, length - T :])
        ref_lses.append(ref_lse[:, :, length - T :])
        if p["dtype"] != "float32":
            baseline = lowp_baseline(spec, q_seq, k_seq, v_seq, p["dtype"], params=seq_params)
            baseline_error = max(baseline_error, max_error(baseline, ref_out))
    ref_out, ref_lse = np.concatenate(refs), np.concatenate(ref_lses)
    verdict = check_forward("float32", out.float().numpy(), lse.numpy(), ref_out, ref_lse)  # rows and LSE
    rule = judge(p["dtype"], {"out": verdict.errors["out"]}, {"out": baseline_error}, {})
    problems = [problem for problem in verdict.problems if not problem.startswith("max |out")] + list(rule.problems)
    assert not problems, problems


@pytest.mark.parametrize("spec_name", SPECS)
@settings(max_examples=3)
@given(p=problems())
def test_kvcache_matches_attention_over_the_whole_sequence(spec_name, p):
    check(spec_name, p)


def test_a_split_of_no_keys_merges_to_nothing():
    """A sliding window visits only its window of the cache; splits beyond it see no key, and the
    merge must not let them change a row (their LSE is -inf)."""
    problem = {
        "dtype": "float32", "batch": 2, "kv_heads": 1, "heads": 2, "new_tokens": 2, "capacity": 192,
        "page_size": 16, "seqlens": [192, 90], "num_splits": 3, "seed": 1,
    }  # fmt: skip
    check("sliding_window", problem)


def test_a_cache_in_another_layout_is_read_in_place():
    """FlashAttention's [batch, max_len, kv_heads, D] cache, as a transposed view: the same result."""
    spec = retarget(load_spec("specs/sliding_window.toml"), 32, "float32")
    module = harness.load_target(spec, "triton_gpu")
    q, k, v = torch.randn(2, 4, 3, 32), torch.randn(2, 70, 2, 32), torch.randn(2, 70, 2, 32)
    lens = torch.tensor([70, 41], dtype=torch.int32)
    strided = module.attention_with_kvcache(q, k.transpose(1, 2), v.transpose(1, 2), lens, window=20)
    copied = module.attention_with_kvcache(
        q, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), lens, window=20
    )
    assert torch.equal(strided, copied)


def test_bad_inputs_are_refused_before_launch():
    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    module = harness.load_target(spec, "triton_gpu")
    q = torch.randn(2, 4, 1, 32)
    cache = torch.randn(2, 2, 64, 32)
    lens = torch.tensor([10, 20], dtype=torch.int32)
    cases = [
        ({"cache_seqlens": lens.long()}, TypeError, "cache_seqlens must be an int32 torch tensor"),
        ({"cache_seqlens": lens[:1]}, ValueError, "cache_seqlens has shape (1,); expected (2,)"),
        ({"k_cache": cache.half()}, TypeError, "k_cache is torch.float16"),
        ({"k_cache": torch.randn(2, 3, 64, 32)}, ValueError, "shapes do not match"),
        ({"k_cache": cache.transpose(2, 3).contiguous().transpose(2, 3)}, ValueError, "contiguous last dim"),
        ({"block_table": torch.zeros(2, 4)}, TypeError, "block_table must be an int32 torch tensor"),
        (
            {"k_cache": torch.randn(3, 2, 64, 32), "v_cache": torch.randn(3, 2, 64, 32)},
            ValueError,
            "one sequence per batch",
        ),
        ({"num_splits": 0}, ValueError, "num_splits must be a positive int"),
    ]
    for change, kind, message in cases:
        args = {"q": q, "k_cache": cache, "v_cache": cache, "cache_seqlens": lens} | change
        with pytest.raises(kind, match=message.replace("(", r"\(").replace(")", r"\)")):
            module.attention_with_kvcache(
                args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"), **args
            )
