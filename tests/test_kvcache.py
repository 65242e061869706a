"""attention_with_kvcache (the decode family): the newest tokens of each sequence against its KV
cache, contiguous or paged, split over programs or not, with grouped query heads, against the
float64 reference of attention over the whole sequence (its last rows) -- the same problems on
both targets: the Triton interpreter and Pallas in TPU interpret mode."""

import functools
import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attngen.exactness import check_forward, judge, lowp_baseline, max_error, round_to
from attngen.reference import attention_ref
from attngen.spec import load_spec, retarget, with_config
from attngen.testing import example_params
from tests import harness
from tests.strategies import exact_specs
from tests.test_fuzz import examples

# Specs whose params make sense at any cache position (varlen packs several sequences in one row).
SPECS = [
    "alibi",
    "causal",
    "full",
    "prefix_lm",
    "strided",
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
    "score_cutoff",
    "sinks",
    "tree_verify",
]


@st.composite
def problems(draw):
    kv_heads = draw(st.integers(1, 2))
    new_tokens = draw(st.integers(1, 5))
    batch = draw(st.integers(1, 3))
    paged = draw(st.booleans())
    page_size = draw(st.sampled_from([16, 32, 64])) if paged else None
    capacity = draw(st.sampled_from([64, 128, 192])) if paged else draw(st.integers(new_tokens, 200))
    seqlens = draw(st.lists(st.integers(new_tokens, capacity), min_size=batch, max_size=batch))
    # Ragged (cu_seqlens_q): up to new_tokens new tokens a sequence, none for some.
    ragged = draw(st.booleans())
    # An FP8 cache read through descale factors (k_descale, v_descale).
    return {
        "dtype": draw(st.sampled_from(["float32", "float16", "bfloat16"])),
        "batch": batch,
        "kv_heads": kv_heads,
        "heads": kv_heads * draw(st.sampled_from([1, 2, 4])),
        "new_tokens": new_tokens,
        "tokens": draw(st.lists(st.integers(0, new_tokens), min_size=batch, max_size=batch)) if ragged else None,
        "capacity": capacity,
        "page_size": page_size,
        "seqlens": seqlens,
        # Left padding (cache_leftpad): each sequence's first row in its cache, or none given.
        "leftpad": draw(st.none() | st.tuples(*(st.integers(0, length - new_tokens) for length in seqlens))),
        "num_splits": draw(st.sampled_from([None, 1, 2, 3])),
        "fp8": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }


def _as_cache(rows, table, num_pages, page_size):
    """Each sequence's rows [batch, kv_heads, capacity, dim] as the kernel takes them: the same array
    (contiguous), or pages [num_pages, kv_heads, page_size, dim] under the block table; pages no
    sequence uses hold NaN, so reading one cannot go unnoticed."""
    if table is None:
        return rows
    pages = np.full((num_pages, rows.shape[1], page_size, rows.shape[3]), np.nan, np.float32)
    for b, sequence_pages in enumerate(table):
        for j, page in enumerate(sequence_pages):
            pages[page] = rows[b, :, j * page_size : (j + 1) * page_size]
    return pages


def _as_e4m3(x):
    """x rounded to float8 e4m3 (FP8 caches' values), as float32."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.float8_e4m3fn).float().numpy()


def _pallas_module(spec):
    """The Pallas module with 128-key blocks: caches of up to 200 keys span two, so EMPTY blocks
    are skipped (and not fetched) and a paged block is made of several pages."""
    return harness.load_target(with_config(spec, "pallas_tpu", block_kv=128), "pallas_tpu")


def _run(
    target, spec, dtype, q, k_cache, v_cache, seqlens, table, leftpad, num_splits, params, cache_dtype=None, **call
):
    """(out, lse) as float32 numpy arrays from `target`'s attention_with_kvcache on float32 inputs
    holding `dtype` values (the caches: cache_dtype's, default dtype); num_splits is Triton's (Pallas
    does not split); call: more arguments (cu_seqlens_q, descale factors), numpy arrays."""
    params = dict(params, **{name: value for name, value in call.items() if value is not None})
    cache_dtype = cache_dtype or dtype
    if target == "triton_gpu":
        module, torch_dtype, torch_cache = (
            harness.load_target(spec, "triton_gpu"),
            getattr(torch, dtype),
            getattr(torch, cache_dtype),
        )
        out, lse = module.attention_with_kvcache(
            torch.from_numpy(q).to(torch_dtype),
            *(torch.from_numpy(x).to(torch_cache) for x in (k_cache, v_cache)),
            torch.from_numpy(seqlens),
            block_table=None if table is None else torch.from_numpy(table),
            cache_leftpad=None if leftpad is None else torch.from_numpy(leftpad),
            return_lse=True,
            num_splits=num_splits,
            **harness.params_as(params, torch.as_tensor),
        )
        return out.float().numpy(), lse.numpy()
    import jax.numpy as jnp

    out, lse = _pallas_module(spec).attention_with_kvcache(
        jnp.asarray(q).astype(dtype),
        *(jnp.asarray(x).astype(cache_dtype) for x in (k_cache, v_cache)),
        jnp.asarray(seqlens),
        block_table=None if table is None else jnp.asarray(table),
        cache_leftpad=None if leftpad is None else jnp.asarray(leftpad),
        return_lse=True,
        interpret=True,
        **harness.params_as(params, jnp.asarray),
    )
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


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


def check(spec_name: str, p: dict, target: str = "triton_gpu"):
    """Problem p (problems()) with spec specs/{spec_name}.toml at head_dim 32 and p's dtype."""
    base = load_spec(f"specs/{spec_name}.toml")
    spec = retarget(base, 32 if base.head_dim_v is None else base.head_dim, p["dtype"])
    params = example_params(spec_name, p["batch"], p["heads"], p["capacity"], p["capacity"], seed=p["seed"])
    check_spec(spec, params, p, target)


def check_spec(spec, params: dict, p: dict, target: str):
    """attention_with_kvcache of `spec` on problem p against the float64 reference of attention
    over each whole sequence (its new rows), by attngen.exactness's rule."""
    rng = np.random.default_rng(p["seed"])
    B, H, T, cap, kv_heads = p["batch"], p["heads"], p["new_tokens"], p["capacity"], p["kv_heads"]
    draw = lambda *shape: round_to(rng.standard_normal(shape).astype(np.float32), p["dtype"])
    tokens = p.get("tokens") or [T] * B  # each sequence's new tokens
    q_new = [draw(H, t, spec.head_dim) for t in tokens]
    k_rows, v_rows = draw(B, kv_heads, cap, spec.head_dim), draw(B, kv_heads, cap, spec.value_dim)
    k_cached, v_cached, descales = k_rows, v_rows, (None, None)
    if p.get("fp8"):  # the cache holds e4m3 values; the true keys and values are those times their factors
        descales = rng.uniform(0.25, 2.0, (2, B, kv_heads)).astype(np.float32)
        k_cached, v_cached = (_as_e4m3(rows / d[:, :, None, None]) for rows, d in zip((k_rows, v_rows), descales))
        k_rows, v_rows = (cached * d[:, :, None, None] for cached, d in zip((k_cached, v_cached), descales))
    table, num_pages = None, 0
    if p["page_size"] is not None:
        pages_per_sequence = cap // p["page_size"]
        num_pages = B * pages_per_sequence + 3  # a few pages no sequence uses
        table = rng.permutation(num_pages)[: B * pages_per_sequence].reshape(B, pages_per_sequence)
    k_cache, v_cache = (_as_cache(rows, table, num_pages, p["page_size"]) for rows in (k_cached, v_cached))
    seqlens = np.array(p["seqlens"], np.int32)
    table = None if table is None else table.astype(np.int32)
    leftpad = None if p.get("leftpad") is None else np.array(p["leftpad"], np.int32)
    if p.get("tokens") is None:
        q, cu_seqlens_q = np.stack(q_new), None
    else:  # packed [total_q, heads, dim]
        q, cu_seqlens_q = np.concatenate(q_new, axis=1).transpose(1, 0, 2), np.cumsum([0, *tokens], dtype=np.int32)
    out, lse = _run(
        target, spec, p["dtype"], q, k_cache, v_cache, seqlens, table, leftpad, p["num_splits"], params,
        "float8_e4m3fn" if p.get("fp8") else None, cu_seqlens_q=cu_seqlens_q, k_descale=descales[0], v_descale=descales[1],
    )  # fmt: skip
    if cu_seqlens_q is not None:  # as [1, heads, total_q, ...], the sequences end to end
        out, lse = out.transpose(1, 0, 2)[None], lse[None]
    # The new rows of every sequence, judged at once. The same-precision baseline's error is taken
    # over every row of the sequences: a handful of new rows is too few for a steady maximum.
    refs, ref_lses, baseline_error = [], [], 0.0
    for b, end in enumerate(p["seqlens"]):
        # The whole sequence (its cache rows from its left padding on): earlier queries drawn
        # afresh, the new tokens last.
        start = 0 if leftpad is None else leftpad[b]
        length = end - start
        q_seq = draw(1, H, length, spec.head_dim)
        q_seq[:, :, length - tokens[b] :] = q_new[b]
        k_seq, v_seq = k_rows[b : b + 1, :, start:end], v_rows[b : b + 1, :, start:end]
        seq_params = _sequence_params(params, spec, b, length)
        ref_out, ref_lse = attention_ref(spec, q_seq, k_seq, v_seq, **seq_params)
        refs.append(ref_out[:, :, length - tokens[b] :])
        ref_lses.append(ref_lse[:, :, length - tokens[b] :])
        if p["dtype"] != "float32":
            baseline = lowp_baseline(spec, q_seq, k_seq, v_seq, p["dtype"], params=seq_params)
            baseline_error = max(baseline_error, max_error(baseline, ref_out))
    axis = 0 if cu_seqlens_q is None else 2  # (packed: the sequences' rows end to end)
    ref_out, ref_lse = np.concatenate(refs, axis=axis), np.concatenate(ref_lses, axis=axis)
    verdict = check_forward("float32", out, lse, ref_out, ref_lse)  # rows and LSE
    rule = judge(p["dtype"], {"out": verdict.errors["out"]}, {"out": baseline_error}, {})
    problems = [problem for problem in verdict.problems if not problem.startswith("max |out")] + list(rule.problems)
    assert not problems, problems


@pytest.mark.parametrize("spec_name", SPECS)
@settings(max_examples=examples(3, share=0.05))
@given(p=problems())
def test_kvcache_matches_attention_over_the_whole_sequence(spec_name, p):
    check(spec_name, p)


@pytest.mark.parametrize("spec_name", SPECS)
@settings(max_examples=examples(1, share=0.005))
@given(p=problems())
def test_pallas_kvcache_matches_attention_over_the_whole_sequence(spec_name, p):
    """The same problems in TPU interpret mode (one a spec: each shape compiles its own kernel)."""
    check(spec_name, p, "pallas_tpu")


@pytest.mark.parametrize("target, count", [("triton_gpu", 6), ("pallas_tpu", 2)])
def test_drawn_specs_decode_exactly(target, count):
    """Specs drawn as tests/test_fuzz.py draws them (masks and scores of the language, sinks, head
    dims 16-64), on drawn decode problems: the tile bounds of masks no spec of specs/ has."""

    @settings(max_examples=examples(count, share=0.01), deadline=None)
    @given(drawn=exact_specs(), p=problems())
    def decode(drawn, p):
        spec = harness.spec_from_text(drawn.text)
        check_spec(retarget(spec, spec.head_dim, p["dtype"]), drawn.params, p, target)

    decode()


def test_pallas_pages_larger_than_a_block():
    """Pages of 256 keys hold two 128-key blocks: a block is read from inside its page; the window
    leaves the first blocks of the long sequence EMPTY (clamped: not fetched)."""
    problem = {
        "dtype": "float32", "batch": 2, "kv_heads": 2, "heads": 4, "new_tokens": 3, "capacity": 512,
        "page_size": 256, "seqlens": [500, 200], "num_splits": None, "seed": 3,
    }  # fmt: skip
    check("sliding_window", problem, "pallas_tpu")


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
@pytest.mark.parametrize(
    "spec_name, page_size",
    [("causal", None), ("sliding_window", 16), ("alibi", 32), ("document", 16), ("relative_bias", None)],
)
def test_left_padded_sequences_start_where_cache_leftpad_says(target, spec_name, page_size):
    """cache_leftpad (FlashAttention's): sequence b is its cache's rows leftpad[b] .. seqlens[b] - 1,
    its positions counted from there; starts inside a block (of either target), a sequence that
    fills its cache, one of 5 keys, over pages and splits; tensor params read at those positions."""
    problem = {
        "dtype": "float32", "batch": 3, "kv_heads": 2, "heads": 4, "new_tokens": 3, "capacity": 192,
        "page_size": page_size, "seqlens": [192, 150, 70], "leftpad": [0, 77, 65], "num_splits": 2, "seed": 5,
    }  # fmt: skip
    check(spec_name, problem, target)


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_a_pool_of_cache_slots_is_a_block_table_of_one_page_each(target):
    """FlashAttention's cache_batch_idx (batch entry b reads cache slot idx[b] of a pool): a block
    table of one page per sequence, the page a whole slot. The same output as the slots gathered."""
    rng = np.random.default_rng(8)
    slots, batch, kv_heads, heads, length = 5, 3, 2, 4, 96
    q = rng.standard_normal((batch, heads, 2, 32)).astype(np.float32)
    pool_k, pool_v = (rng.standard_normal((slots, kv_heads, length, 32)).astype(np.float32) for _ in range(2))
    index = np.array([4, 0, 2], np.int32)
    lens = np.array([96, 40, 7], np.int32)
    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    pooled = _run(target, spec, "float32", q, pool_k, pool_v, lens, index[:, None], None, None, {})
    gathered = _run(target, spec, "float32", q, pool_k[index], pool_v[index], lens, None, None, None, {})
    for got, want in zip(pooled, gathered, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
@pytest.mark.parametrize(
    "spec_name, page_size, leftpad",
    [("causal", None, None), ("sliding_window", 16, None), ("relative_bias", None, [0, 9, 0, 30]), ("sinks", 32, None)],
)
def test_ragged_new_tokens_are_packed_as_cu_seqlens_q_says(target, spec_name, page_size, leftpad):
    """cu_seqlens_q (FlashAttention's, vLLM's mixed batches): a prefill chunk of 20 tokens (two
    tiles of 64 rows on Triton), a sequence with none, a few speculative tokens and one decoding
    token in one call, over splits; positions, head-dependent bounds, gathered tensors and sinks
    all per sequence."""
    problem = {
        "dtype": "float32", "batch": 4, "kv_heads": 1, "heads": 4, "new_tokens": 20, "tokens": [20, 0, 3, 1],
        "capacity": 192, "page_size": page_size, "seqlens": [60, 40, 192, 97], "leftpad": leftpad, "num_splits": 2, "seed": 9,
    }  # fmt: skip
    check(spec_name, problem, target)


def test_ragged_slots_under_jit_take_max_seqlen_q_for_their_size():
    """Under jax.jit the offsets are traced: max_seqlen_q sizes the Pallas slots (4 tokens: the
    20-token sequence takes five of them), and the result is the eager call's."""
    import jax
    import jax.numpy as jnp

    spec = retarget(load_spec("specs/sliding_window.toml"), 32, "float32")
    module = _pallas_module(spec)
    rng = np.random.default_rng(2)
    cu = jnp.asarray([0, 20, 20, 23, 24], jnp.int32)
    q = jnp.asarray(rng.standard_normal((24, 4, 32)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((4, 2, 192, 32)), jnp.float32)
    lens = jnp.asarray([60, 40, 192, 97], jnp.int32)

    def call(cu, max_seqlen_q):
        ragged = {"cu_seqlens_q": cu, "max_seqlen_q": max_seqlen_q}
        return module.attention_with_kvcache(
            q, cache, cache, lens, **ragged, return_lse=True, interpret=True, window=24
        )

    eager = call(cu, None)
    traced = jax.jit(call, static_argnums=1)(cu, 4)
    for got, want in zip(traced, eager, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6)


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_ragged_calls_append_packed_keys_to_caches_in_either_layout(target):
    """With cu_seqlens_q, k and v are packed as q and appended at each sequence's end, and caches in
    FlashAttention's layout are read as such: the same output and caches as a call per sequence."""
    rng = np.random.default_rng(4)
    tokens, lens = [2, 0, 3], np.array([30, 5, 61], np.int32)  # lengths before the append
    cu = np.cumsum([0, *tokens], dtype=np.int32)
    q = rng.standard_normal((5, 4, 32)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((5, 2, 32)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (rng.standard_normal((3, 64, 2, 32)).astype(np.float32) for _ in range(2))  # bshd
    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    if target == "triton_gpu":
        module, wrap, extra = harness.load_target(spec, "triton_gpu"), lambda x: torch.from_numpy(np.array(x)), {}
    else:
        import jax.numpy as jnp

        module, wrap, extra = _pallas_module(spec), jnp.asarray, {"interpret": True}

    def attend(q, k_cache, v_cache, lens, k, v, **ragged):
        """(out, k_cache, v_cache) after the call, as numpy."""
        caches = [wrap(k_cache), wrap(v_cache)]
        args = dict(k=wrap(k), v=wrap(v), layout="bshd", **ragged, **extra)
        result = module.attention_with_kvcache(wrap(q), *caches, wrap(lens), **args)
        out, caches = (result, caches) if target == "triton_gpu" else (result[0], result[1:])
        return [np.asarray(x) for x in (out, *caches)]

    out, k_after, v_after = attend(q, k_cache, v_cache, lens, k_new, v_new, cu_seqlens_q=wrap(cu))
    for b in np.flatnonzero(tokens):
        rows = slice(cu[b], cu[b + 1])
        one = attend(
            q[None, rows], k_cache[b : b + 1], v_cache[b : b + 1], lens[b : b + 1], k_new[None, rows], v_new[None, rows]
        )
        np.testing.assert_array_equal(out[rows], one[0][0])
        np.testing.assert_array_equal(k_after[b], one[1][0])
        np.testing.assert_array_equal(v_after[b], one[2][0])
    np.testing.assert_array_equal(k_after[1], k_cache[1])  # (no token: nothing appended)


def test_the_layers_of_a_step_check_their_shared_offsets_once(monkeypatch):
    """The offsets' check costs a host synchronisation: the layers of one decoding step share one
    cu_seqlens_q tensor and check it once; changed in place, it is checked again (and refused if bad)."""
    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    module = harness.load_target(spec, "triton_gpu")
    g = torch.Generator().manual_seed(1)
    q, cache = torch.randn(5, 4, 32, generator=g), torch.randn(2, 2, 64, 32, generator=g)
    lens, cu = torch.tensor([30, 40], dtype=torch.int32), torch.tensor([0, 2, 5], dtype=torch.int32)
    syncs = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t, tolist=torch.Tensor.tolist: syncs.append(1) or tolist(t))
    layers = [module.attention_with_kvcache(q, cache, cache, lens, cu_seqlens_q=cu) for _ in range(3)]
    assert len(syncs) == 1 and all(torch.equal(out, layers[0]) for out in layers)
    cu[1] = 6  # in place: the version changes
    with pytest.raises(ValueError, match="never decrease"):
        module.attention_with_kvcache(q, cache, cache, lens, cu_seqlens_q=cu)


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_bad_cu_seqlens_q_are_refused_before_launch(target):
    """Offsets that do not start at 0, decrease, or miss q's length; the wrong dtype; a 4-D q."""
    rng = np.random.default_rng(0)
    q, cache = (
        rng.standard_normal((5, 4, 32)).astype(np.float32),
        rng.standard_normal((2, 2, 64, 32)).astype(np.float32),
    )
    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    if target == "triton_gpu":
        module, wrap, extra = harness.load_target(spec, "triton_gpu"), torch.from_numpy, {}
    else:
        import jax.numpy as jnp

        module, wrap, extra = _pallas_module(spec), jnp.asarray, {"interpret": True}
    cases = [
        (np.array([1, 3, 5], np.int32), ValueError, "must start at 0, never decrease and end at 5"),
        (np.array([0, 6, 5], np.int32), ValueError, "must start at 0, never decrease and end at 5"),
        (np.array([0, 2, 4], np.int32), ValueError, "must start at 0, never decrease and end at 5"),
        (np.array([0, 2, 5], np.float32), TypeError, "cu_seqlens_q must be an int32"),
        (np.array([0, 2, 5, 5], np.int32), ValueError, "one sequence per batch entry: .* 3 sequences"),
    ]
    lens = wrap(np.array([30, 40], np.int32))
    for cu, kind, message in cases:
        with pytest.raises(kind, match=message):
            module.attention_with_kvcache(wrap(q), wrap(cache), wrap(cache), lens, cu_seqlens_q=wrap(cu), **extra)
    with pytest.raises(ValueError, match=r"q must be a 3-D .* \[total_q, heads, head_dim\]"):
        module.attention_with_kvcache(
            wrap(q[None]), wrap(cache), wrap(cache), lens, cu_seqlens_q=wrap(cases[0][0]), **extra
        )
    out = module.attention_with_kvcache(
        wrap(q), wrap(cache), wrap(cache), lens, cu_seqlens_q=wrap(np.array([0, 2, 5], np.int32)), **extra
    )
    assert tuple(out.shape) == (5, 4, 32)  # the unchanged inputs run: the refusals came from the changes alone


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("q_magnitude", [1.0, 2.0**-20, 2.0**20])
def test_an_fp8_cache_reads_as_its_values_times_their_factors(target, page_size, q_magnitude):
    """An FP8 cache with power-of-two descale factors per (sequence, kv head) against a bfloat16
    cache holding e4m3 values times their factors (exact in bfloat16); over splits, ragged tokens
    too. Pallas widens e4m3 to bfloat16, exactly, and scales q.k and the output by the factors,
    exactly: the same bits. Triton multiplies in float16, q shifted by a power of two into its range
    (P in float16 too): judged against the float32 kernel by the bfloat16 rule, the bfloat16
    cache's error as the baseline, at queries of any magnitude."""
    spec = retarget(load_spec("specs/sliding_window.toml"), 32, "bfloat16")
    rng = np.random.default_rng(6)
    batch, kv_heads, heads, capacity = 3, 2, 4, 128
    e4m3 = [_as_e4m3(2 * rng.standard_normal((batch, kv_heads, capacity, 32))) for _ in range(2)]
    factors = (2.0 ** rng.integers(-3, 4, (2, batch, kv_heads))).astype(np.float32)
    exact = [x * f[:, :, None, None] for x, f in zip(e4m3, factors)]
    table = None if page_size is None else rng.permutation(batch * 8).reshape(batch, 8).astype(np.int32)
    caches = [_as_cache(x, table, batch * 8, page_size) for x in (*e4m3, *exact)]
    q = round_to(q_magnitude * rng.standard_normal((6, heads, 32)).astype(np.float32), "bfloat16")
    lens, cu = np.array([128, 70, 9], np.int32), np.array([0, 3, 4, 6], np.int32)
    run = functools.partial(_run, target, spec, "bfloat16", q, num_splits=2, params={"window": 50}, cu_seqlens_q=cu)
    fp8 = run(*caches[:2], lens, table, None, cache_dtype="float8_e4m3fn", k_descale=factors[0], v_descale=factors[1])
    bf16 = run(*caches[2:], lens, table, None)
    if target == "pallas_tpu":
        for got, want in zip(fp8, bf16, strict=True):
            np.testing.assert_array_equal(got, want)
        return
    float32 = retarget(spec, 32, "float32")
    wide = _run(target, float32, "float32", q, *caches[2:], lens, table, None, 2, {"window": 50}, cu_seqlens_q=cu)
    as_bhsd = lambda out, lse: (out.transpose(1, 0, 2)[None], lse[None])  # [1, H, total_q, ...]
    verdict = check_forward("float32", *as_bhsd(*fp8), *as_bhsd(*wide))  # (the rows without keys, the LSE)
    rule = judge("bfloat16", {"out": max_error(fp8[0], wide[0])}, {"out": max_error(bf16[0], wide[0])})
    problems = [problem for problem in verdict.problems if not problem.startswith("max |out")] + list(rule.problems)
    assert not problems, problems


def test_descale_factors_and_cache_dtypes_are_checked():
    """Factors of another shape; caches of two dtypes; an FP8 q (only caches may be FP8)."""
    spec = retarget(load_spec("specs/causal.toml"), 32, "bfloat16")
    module = harness.load_target(spec, "triton_gpu")
    q, cache = torch.randn(2, 4, 1, 32).bfloat16(), torch.randn(2, 2, 64, 32).to(torch.float8_e4m3fn)
    lens = torch.tensor([30, 40], dtype=torch.int32)
    with pytest.raises(
        ValueError, match=r"k_descale must be one number or \[batch, kv_heads\] = \[2, 2\], got \[2, 4\]"
    ):
        module.attention_with_kvcache(q, cache, cache, lens, k_descale=torch.ones(2, 4))
    with pytest.raises(TypeError, match="caches of one dtype"):
        module.attention_with_kvcache(q, cache, cache.bfloat16(), lens)
    with pytest.raises(
        TypeError, match=r"q is torch.float8_e4m3fn; this kernel was generated for torch.bfloat16 \(the spec's dtype\)$"
    ):
        module.attention_with_kvcache(q.to(torch.float8_e4m3fn), cache, cache, lens)
    out = module.attention_with_kvcache(q, cache, cache, lens, k_descale=0.5, v_descale=torch.full((2, 2), 2.0))
    assert out.shape == (2, 4, 1, 32) and out.dtype == torch.bfloat16  # the unchanged inputs run
    # Numbers alone give the factors as tensors would (their [batch, kv_heads, 2] kept for the next call).
    assert torch.equal(module.attention_with_kvcache(q, cache, cache, lens, k_descale=0.5, v_descale=2.0), out)
    assert module._fp8_descales(q.device, 2, 2, None, 0.5, 2.0) is module._fp8_descales(q.device, 2, 2, None, 0.5, 2.0)


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_tree_verification_sees_the_prefix_and_each_drafts_ancestors(target):
    """specs/tree_verify.toml, against its definition: draft token i of a tree attends to the tokens
    before the drafts and to its ancestors (and itself), as a causal attention over a cache holding
    just those, its own key last."""
    from attngen.testing import draft_tree

    rng = np.random.default_rng(11)
    drafts, prefix, kv_heads, heads = 6, 70, 2, 4
    tree = draft_tree(rng, drafts)
    k, v = (rng.standard_normal((1, kv_heads, prefix + drafts, 32)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, heads, drafts, 32)).astype(np.float32)
    lens = np.array([prefix + drafts], np.int32)
    params = {"tree": tree[None], "drafts": drafts}
    spec = retarget(load_spec("specs/tree_verify.toml"), 32, "float32")
    out, _ = _run(target, spec, "float32", q, k, v, lens, None, None, None, params)
    causal = retarget(load_spec("specs/causal.toml"), 32, "float32")
    for i in range(drafts):
        seen = np.concatenate([np.arange(prefix), prefix + np.flatnonzero(tree[i])])  # i itself last
        one, _ = _run(
            target,
            causal,
            "float32",
            q[:, :, i : i + 1],
            k[:, :, seen],
            v[:, :, seen],
            np.array([len(seen)], np.int32),
            None,
            None,
            None,
            {},
        )
        np.testing.assert_allclose(out[:, :, i], one[:, :, 0], atol=2e-6, rtol=0)


@pytest.mark.parametrize("target", ["triton_gpu", "pallas_tpu"])
def test_a_shared_prefix_is_attended_once_for_every_sequence_then_merged(target):
    """Cascade attention (FlashInfer's, for a system prompt every request shares): the new tokens of
    every request against the shared prefix as one sequence of spec full (the prefix precedes them
    all), each request against its own suffix with spec causal (positions counted from the suffix:
    causal is shift-invariant), and merge_partials: the same as causal over prefix and suffix."""
    rng = np.random.default_rng(12)
    batch, heads, kv_heads, tokens, prefix, most = 3, 4, 2, 2, 70, 40
    suffix_lens = np.array([5, 40, 12], np.int32)  # the new tokens last
    q = rng.standard_normal((batch, heads, tokens, 32)).astype(np.float32)
    shared_k, shared_v = (rng.standard_normal((1, kv_heads, prefix, 32)).astype(np.float32) for _ in range(2))
    own_k, own_v = (rng.standard_normal((batch, kv_heads, most, 32)).astype(np.float32) for _ in range(2))
    full, causal = (retarget(load_spec(f"specs/{name}.toml"), 32, "float32") for name in ("full", "causal"))
    # One call over each whole sequence: the prefix, then the request's own keys.
    whole = [
        np.concatenate([np.repeat(shared, batch, 0), own], axis=2)
        for shared, own in ((shared_k, own_k), (shared_v, own_v))
    ]
    want, _ = _run(target, causal, "float32", q, *whole, prefix + suffix_lens, None, None, None, {})
    # The cascade: every request's queries as the new tokens of one sequence over the prefix.
    as_one = q.transpose(1, 0, 2, 3).reshape(1, heads, batch * tokens, 32)
    shared = _run(
        target, full, "float32", as_one, shared_k, shared_v, np.array([prefix], np.int32), None, None, None, {}
    )
    shared = (
        shared[0].reshape(heads, batch, tokens, 32).transpose(1, 0, 2, 3),
        shared[1].reshape(heads, batch, tokens).transpose(1, 0, 2),
    )
    own = _run(target, causal, "float32", q, own_k, own_v, suffix_lens, None, None, None, {})
    if target == "triton_gpu":
        module, wrap = harness.load_target(causal, "triton_gpu"), torch.from_numpy
    else:
        import jax.numpy as jnp

        module, wrap = _pallas_module(causal), jnp.asarray
    got, _ = module.merge_partials(*(wrap(np.ascontiguousarray(x)) for x in (*shared, *own)))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-6, rtol=0)


def test_a_split_of_no_keys_merges_to_nothing():
    """A sliding window visits only its window of the cache; splits beyond it see no key, and the
    merge must not let them change a row (their LSE is -inf)."""
    problem = {
        "dtype": "float32", "batch": 2, "kv_heads": 1, "heads": 2, "new_tokens": 2, "capacity": 192,
        "page_size": 16, "seqlens": [192, 90], "num_splits": 3, "seed": 1,
    }  # fmt: skip
    check("sliding_window", problem)


@pytest.mark.parametrize("page_size", [16, 24, 128])
def test_pages_smaller_than_a_block_larger_or_neither(page_size):
    """The three ways a kv block finds its keys' pages: whole pages in a block (one lookup a page),
    a page holding whole blocks (one a block), and any other size (one a key)."""
    problem = {
        "dtype": "float32", "batch": 2, "kv_heads": 2, "heads": 4, "new_tokens": 3, "capacity": 384,
        "page_size": page_size, "seqlens": [384, 101], "num_splits": 2, "seed": 4,
    }  # fmt: skip
    check("causal", problem)


@pytest.mark.parametrize("spec_name", ["sliding_window", "sinks"])
@pytest.mark.parametrize("heads, new_tokens, chunk, walk", [(4, 2, 2, (2, 1)), (2, 1, 8, (2, 4))])
def test_the_last_split_merges_in_chunks(spec_name, heads, new_tokens, chunk, walk, monkeypatch):
    """The last split merges DECODE_MERGE_CHUNK partial outputs at a time, rows first, then splits: at
    two a chunk, eight rows take four chunks of rows, each over five splits one by one; at eight, two
    rows take five splits four at a time (the last chunk short). Splits past the window see no key;
    a sink joins each row once."""
    spec = retarget(load_spec(f"specs/{spec_name}.toml"), 32, "float32")
    module = harness.load_target(spec, "triton_gpu")
    monkeypatch.setattr(module, "DECODE_MERGE_CHUNK", chunk * module.BLOCK_DV)
    assert module._merge_chunk(heads * new_tokens, 5) == walk
    problem = {
        "dtype": "float32", "batch": 2, "kv_heads": 1, "heads": heads, "new_tokens": new_tokens, "capacity": 192,
        "page_size": None, "seqlens": [192, 90], "num_splits": 5, "seed": 2,
    }  # fmt: skip
    check(spec_name, problem)


def test_a_reused_workspace_gives_the_same_bits_and_is_left_zero():
    """Given a workspace, a call's last splits zero their counters again: the next call (a CUDA graph's
    replay) finds them ready, with no memset. A workspace refused leaves the cache unappended."""
    spec = retarget(load_spec("specs/sliding_window.toml"), 32, "float32")
    module = harness.load_target(spec, "triton_gpu")
    q, k_cache, v_cache = torch.randn(2, 4, 3, 32), torch.randn(2, 2, 96, 32), torch.randn(2, 2, 96, 32)
    lens = torch.tensor([96, 50], dtype=torch.int32)
    fresh = module.attention_with_kvcache(q, k_cache, v_cache, lens, window=40, num_splits=3)
    workspace = module.kvcache_workspace("cpu", tiles=8)
    for _ in range(2):
        reused = module.attention_with_kvcache(q, k_cache, v_cache, lens, window=40, num_splits=3, workspace=workspace)
        assert torch.equal(reused, fresh) and not workspace.any()
    before = k_cache.clone()
    with pytest.raises(ValueError, match="the workspace counts 1"):
        module.attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            lens - 3,
            k=torch.randn(2, 2, 3, 32),
            v=torch.randn(2, 2, 3, 32),
            window=40,
            workspace=module.kvcache_workspace("cpu", tiles=1),
        )
    assert torch.equal(k_cache, before)


def test_split_grids_fill_the_gpu_once_or_many_times(monkeypatch):
    """The split rule keeps decode grids of 16-row tiles at most DECODE_PROGRAMS_PER_SM programs per
    SM or at least five times as many, away from the grids of twice as many that read 8-16 % slower
    on the H200 (BENCHMARKS.md, 2026-12-02), and a tile in at most 16 splits (more lost at batch 1);
    taller tiles (many new tokens) split only to fill the GPU (2026-12-05)."""
    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    monkeypatch.setattr(module, "_sm_count", lambda device: 132)  # an H100 / H200
    slots = module.DECODE_PROGRAMS_PER_SM * 132
    for tiles in range(1, 16 * slots):
        splits = module._decode_splits(tiles, 2**17, torch.device("cpu"), module.DECODE_PROGRAMS_PER_SM, 16)
        grids = tiles * splits / slots
        assert 1 <= splits <= 16 and (grids <= 1 or grids >= 5), (tiles, splits)
    assert module._decode_splits(8, 2**17, None, 2, 16) == 16  # batch 1, 8 kv heads
    assert module._decode_splits(512, 2**15, None, 2, 16) == 4  # batch 64: about eight times 264 programs
    assert module._decode_splits(512, 2**15, None, 2, 64) == 1  # tiles of 64 rows (16 tokens): no more
    assert module._decode_splits(64, 2**15, None, 2, 64) == 4  # ... than fill the grid (batch 8)
    assert module._decode_splits(200, 2**15, None, 2, 16) == 1  # 200 tiles fill 264 slots once
    assert module._decode_splits(200, 2**15, None, 4, 16) == 2  # an FP8 cache's four programs an SM: 528 slots


def test_long_splits_walk_wider_kv_blocks(monkeypatch):
    """One program per SM over long splits of tiles of 16 rows steps DECODE_LONG_BLOCK_N keys at a
    time (H200: 16-token pages at batch 1, 128k keys, 0.89 -> 0.96x the contiguous cache); fewer keys
    a split, more rows a tile, more programs than SMs, other GPUs and the interpreter keep 64. The
    wider step is exact through pages of 16 keys (eight a step) and a contiguous cache."""
    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    monkeypatch.setattr(module, "_sm_count", lambda device: 132)  # an H100 / H200
    monkeypatch.setattr(module, "_tma", lambda device: True)
    cuda = torch.device("cuda")  # (a device object: nothing runs on it)
    keys, fp8_keys = module.DECODE_LONG_SPLIT_KEYS, module.DECODE_FP8_LONG_SPLIT_KEYS
    assert module._long_splits(2**17, 16, 128, 16, cuda, keys)  # batch 1, 8 kv heads, one token, 128k keys
    assert not module._long_splits(2**15, 16, 128, 16, cuda, keys)  # 2k keys a split
    assert module._long_splits(2**15, 16, 128, 16, cuda, fp8_keys)  # 2k FP8 keys a split
    assert not module._long_splits(2**17, 16, 128, 64, cuda, keys)  # 16 new tokens: 64 rows a tile
    assert not module._long_splits(2**17, 4, 256, 16, cuda, keys)  # batch 8: two programs an SM
    assert not module._long_splits(2**17, 16, 128, 16, torch.device("cpu"), keys)
    wide = retarget(load_spec("specs/causal.toml"), 256, "bfloat16")  # 256-wide heads: 268 KiB of K/V ring
    assert not harness.load_target(wide, "triton_gpu")._long_splits(2**17, 16, 128, 16, cuda, keys)

    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    narrow = harness.load_target(spec, "triton_gpu")
    assert narrow.DECODE_LONG_BLOCK_N > narrow.DECODE_BLOCK_N
    monkeypatch.setattr(narrow, "_long_splits", lambda *args: True)
    for page_size in (16, None):
        problem = {
            "dtype": "float32", "batch": 2, "kv_heads": 2, "heads": 4, "new_tokens": 1, "capacity": 512,
            "page_size": page_size, "seqlens": [512, 137], "num_splits": 2, "seed": 6,
        }  # fmt: skip
        check("causal", problem)


def test_an_fp8_cache_launches_twice_the_programs_in_fewer_registers(monkeypatch):
    """An FP8 cache's decode grid of 16-row tiles holds DECODE_FP8_PROGRAMS_PER_SM programs per SM,
    compiled within DECODE_FP8_MAX_REGISTERS so that they fit; taller tiles (they would spill) and
    launches of one program per SM or fewer (they walk wide steps instead) are not capped."""
    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    monkeypatch.setattr(module, "_sm_count", lambda device: 132)
    q = torch.zeros(8, 32, 1, 128, dtype=torch.bfloat16)
    cache = torch.zeros(8, 8, 2**15, 128, dtype=torch.bfloat16)
    plain = module._decode_launch(q, cache, None, False, None)
    fp8 = module._decode_launch(q, cache.to(torch.float8_e4m3fn), None, False, None)
    assert fp8.grid[0] == 2 * plain.grid[0]  # 64 tiles: 8 splits each, not 4
    assert fp8.constants["maxnreg"] == module.DECODE_FP8_MAX_REGISTERS and "maxnreg" not in plain.constants
    tokens = torch.zeros(8, 32, 16, 128, dtype=torch.bfloat16)  # 64 rows a tile
    tall = module._decode_launch(tokens, cache.to(torch.float8_e4m3fn), None, False, None)
    assert tall.grid == module._decode_launch(tokens, cache, None, False, None).grid and "maxnreg" not in tall.constants
    monkeypatch.setattr(module, "_tma", lambda device: True)
    monkeypatch.setattr(module, "_long_splits", lambda *args: True)  # (as on the H200 at batch 1)
    wide = module._decode_launch(q[:1], cache[:1].to(torch.float8_e4m3fn), None, False, None)
    assert wide.constants["BLOCK_N"] == module.DECODE_LONG_BLOCK_N and "maxnreg" not in wide.constants


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


def test_one_length_for_every_sequence_may_be_an_int():
    """cache_seqlens as an int (FlashAttention's spelling; transformers' generate passes one): the
    same bits as the tensor of that length on both targets, appending too; on torch the lengths of
    a recent int are one tensor, shared by the calls (the layers of a decoding step)."""
    import jax.numpy as jnp

    spec = retarget(load_spec("specs/sliding_window.toml"), 32, "float32")
    module = harness.load_target(spec, "triton_gpu")
    g = torch.Generator().manual_seed(3)
    q, cache = torch.randn(2, 4, 2, 32, generator=g), torch.randn(2, 2, 64, 32, generator=g)
    lens = torch.tensor([50, 50], dtype=torch.int32)
    by_int = module.attention_with_kvcache(q, cache, cache, 50, window=20)
    assert torch.equal(by_int, module.attention_with_kvcache(q, cache, cache, lens, window=20))
    assert module._cache_seqlens(50, q, 2) is module._cache_seqlens(50, q, 2)
    assert torch.equal(module._cache_seqlens(-3, q, 2), torch.zeros(2, dtype=torch.int32))  # clamped as the kernels do
    k_cache, v_cache = cache.clone(), cache.clone()
    k, v = torch.randn(2, 2, 2, 32, generator=g), torch.randn(2, 2, 2, 32, generator=g)
    appended = module.attention_with_kvcache(q, k_cache, v_cache, 48, k=k, v=v, window=20)
    assert torch.equal(appended, module.attention_with_kvcache(q, k_cache, v_cache, lens, window=20))

    pallas = _pallas_module(spec)
    q_j, cache_j = jnp.asarray(q.numpy()), jnp.asarray(cache.numpy())
    out = pallas.attention_with_kvcache(q_j, cache_j, cache_j, 50, window=20, interpret=True)
    lens_j = jnp.asarray(lens.numpy())
    expected = pallas.attention_with_kvcache(q_j, cache_j, cache_j, lens_j, window=20, interpret=True)
    assert np.array_equal(np.asarray(out), np.asarray(expected))


def test_bad_inputs_are_refused_before_launch():
    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    module = harness.load_target(spec, "triton_gpu")
    q = torch.randn(2, 4, 1, 32)
    cache = torch.randn(2, 2, 64, 32)
    lens = torch.tensor([10, 20], dtype=torch.int32)
    cases = [
        ({"cache_seqlens": lens.long()}, TypeError, "cache_seqlens must be an int or an int32 torch tensor"),
        ({"cache_seqlens": True}, TypeError, "cache_seqlens must be an int or an int32 torch tensor, got bool"),
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
        ({"workspace": torch.zeros(4)}, TypeError, "workspace must be a 1-D int32 torch tensor"),
        ({"workspace": torch.zeros(3, dtype=torch.int32)}, ValueError, "this call has 4 tiles; the workspace counts 3"),
        ({"cache_leftpad": lens.long()}, TypeError, "cache_leftpad must be an int32 torch tensor"),
        ({"cache_leftpad": lens[:1]}, ValueError, "cache_leftpad has shape (1,); expected (2,)"),
    ]
    for change, kind, message in cases:
        args = {"q": q, "k_cache": cache, "v_cache": cache, "cache_seqlens": lens} | change
        with pytest.raises(kind, match=message.replace("(", r"\(").replace(")", r"\)")):
            module.attention_with_kvcache(
                args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"), **args
            )


def test_lengths_are_read_whatever_their_strides():
    """cache_seqlens and cache_leftpad as strided views (every other entry of a larger tensor) give
    what their contiguous copies give: the kernel reads them by index."""
    module = harness.load_target(retarget(load_spec("specs/causal.toml"), 32, "float32"), "triton_gpu")
    generator = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 1, 32, generator=generator)
    k, v = (torch.randn(2, 2, 64, 32, generator=generator) for _ in range(2))
    lens, starts = (
        torch.tensor([64, 5, 10, 7], dtype=torch.int32)[::2],
        torch.tensor([3, 9, 2, 1], dtype=torch.int32)[::2],
    )
    out = module.attention_with_kvcache(q, k, v, lens, cache_leftpad=starts)
    assert torch.equal(
        out, module.attention_with_kvcache(q, k, v, lens.contiguous(), cache_leftpad=starts.contiguous())
    )


@pytest.mark.parametrize("new_tokens", [1, 3])
def test_q_is_read_through_its_strides(new_tokens):
    """q sliced from a fused QKV projection in FlashAttention's layout (transformers' GPT-2 passes
    such views): the same bits as its contiguous copy."""
    module = harness.load_target(retarget(load_spec("specs/causal.toml"), 32, "float32"), "triton_gpu")
    generator = torch.Generator().manual_seed(9)
    fused = torch.randn(2, new_tokens, 4 + 2 * 2, 32, generator=generator)  # [batch, T, q heads + k and v heads, d]
    q = fused[:, :, :4].transpose(1, 2)
    assert not q.is_contiguous()
    k, v = (torch.randn(2, 2, 64, 32, generator=generator) for _ in range(2))
    lens = torch.tensor([64, 20], dtype=torch.int32)
    assert torch.equal(
        module.attention_with_kvcache(q, k, v, lens), module.attention_with_kvcache(q.contiguous(), k, v, lens)
    )


def test_pallas_bad_inputs_are_refused_before_launch():
    """The checks the Triton module makes, shared (attngen/templates/common/checks.py.jinja), on
    jax arrays: what jax arrays cannot get wrong (strides, devices) aside."""
    import jax.numpy as jnp

    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    module = _pallas_module(spec)
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((2, 4, 1, 32)), jnp.float32)
    cache = jnp.asarray(rng.standard_normal((2, 2, 64, 32)), jnp.float32)
    lens = jnp.asarray([10, 20], jnp.int32)
    cases = [
        ({"cache_seqlens": np.array([10, 20], np.int64)}, TypeError, "cache_seqlens must be an int or an int32 array"),
        ({"cache_seqlens": 2.5}, TypeError, "cache_seqlens must be an int or an int32 array, got float"),
        ({"cache_seqlens": lens[:1]}, ValueError, "cache_seqlens has shape (1,); expected (2,)"),
        ({"q": q[0]}, ValueError, "q must be a 4-D array"),
        ({"k_cache": cache.astype(jnp.bfloat16)}, TypeError, "k_cache is bfloat16"),
        ({"v_cache": cache[..., :16]}, ValueError, "v_cache has head_dim 16"),
        ({"k_cache": jnp.zeros((2, 3, 64, 32), jnp.float32)}, ValueError, "shapes do not match"),
        ({"block_table": jnp.zeros((2, 4), jnp.float32)}, TypeError, "block_table must be an int32 array"),
        ({"block_table": jnp.zeros((3, 4), jnp.int32)}, ValueError, "block_table has shape (3, 4); expected (2, 'n')"),
        ({"cache_leftpad": 3}, TypeError, "cache_leftpad must be an int32 array, got int"),
        (
            {"k_cache": jnp.zeros((3, 2, 64, 32), jnp.float32), "v_cache": jnp.zeros((3, 2, 64, 32), jnp.float32)},
            ValueError,
            "one sequence per batch",
        ),
    ]
    for change, kind, message in cases:
        args = {"q": q, "k_cache": cache, "v_cache": cache, "cache_seqlens": lens} | change
        with pytest.raises(kind, match=message.replace("(", r"\(").replace(")", r"\)")):
            module.attention_with_kvcache(
                args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"), **args
            )
    # The unchanged inputs run: the refusals above came from the changes alone.
    assert module.attention_with_kvcache(q, cache, cache, lens, interpret=True).shape == (2, 4, 1, 32)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_new_keys_are_appended_then_attended(paged):
    """k and v given (FlashAttention's append): written into the caches in place at
    cache_seqlens[b] + t, then attended with the longer lengths -- the same as writing them by
    hand first. An append past a sequence's pages raises before anything is written."""
    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    module = harness.load_target(spec, "triton_gpu")
    batch, heads, kv_heads, tokens, page_size, pages = 2, 4, 2, 3, 16, 4  # 64 positions a sequence
    g = torch.Generator().manual_seed(0)
    shape = (batch * pages, kv_heads, page_size, 32) if paged else (batch, kv_heads, pages * page_size, 32)
    k_cache, v_cache = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    table = torch.randperm(batch * pages, generator=g).view(batch, pages).int() if paged else None
    lens = torch.tensor([10, 61], dtype=torch.int32)  # the second fills its last page exactly
    q = torch.randn(batch, heads, tokens, 32, generator=g)
    k, v = (torch.randn(batch, kv_heads, tokens, 32, generator=g) for _ in range(2))
    k_hand, v_hand = k_cache.clone(), v_cache.clone()
    for b in range(batch):
        for t in range(tokens):
            position = int(lens[b]) + t
            where = (int(table[b, position // page_size]), position % page_size) if paged else (b, position)
            k_hand[where[0], :, where[1]], v_hand[where[0], :, where[1]] = k[b, :, t], v[b, :, t]
    expected = module.attention_with_kvcache(q, k_hand, v_hand, lens + tokens, block_table=table)
    out = module.attention_with_kvcache(q, k_cache, v_cache, lens, k=k, v=v, block_table=table)
    assert torch.equal(k_cache, k_hand) and torch.equal(v_cache, v_hand)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="writes positions 11..64; the cache holds 0..63"):
        module.attention_with_kvcache(q, k_cache, v_cache, lens + 1, k=k, v=v, block_table=table)
    assert torch.equal(k_cache, k_hand), "a refused append writes nothing"
    with pytest.raises(ValueError, match="together"):
        module.attention_with_kvcache(q, k_cache, v_cache, lens, k=k, block_table=table)
    with pytest.raises(ValueError, match="k has shape"):
        module.attention_with_kvcache(q, k_cache, v_cache, lens, k=k[:, :1], v=v, block_table=table)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_new_keys_are_appended_then_attended_on_pallas(paged):
    """The Pallas append: jax arrays do not change, so the updated caches come back with the output,
    equal to writing the tokens by hand first; an append past the pages raises (concrete lengths) or
    is dropped (traced ones, under jit)."""
    import jax
    import jax.numpy as jnp

    spec = retarget(load_spec("specs/causal.toml"), 32, "float32")
    module = harness.load_target(spec, "pallas_tpu")
    batch, heads, kv_heads, tokens, page_size, pages = 2, 4, 2, 3, 16, 4
    rng = np.random.default_rng(0)
    shape = (batch * pages, kv_heads, page_size, 32) if paged else (batch, kv_heads, pages * page_size, 32)
    k_cache, v_cache = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    table = rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32) if paged else None
    lens = np.array([10, 61], np.int32)  # the second fills its last page exactly
    q = rng.standard_normal((batch, heads, tokens, 32)).astype(np.float32)
    k, v = (rng.standard_normal((batch, kv_heads, tokens, 32)).astype(np.float32) for _ in range(2))

    def by_hand(lens):
        k_hand, v_hand = k_cache.copy(), v_cache.copy()
        for b, t in itertools.product(range(batch), range(tokens)):
            position = int(lens[b]) + t
            if position < pages * page_size:  # (past the pages: dropped)
                where = (int(table[b, position // page_size]), position % page_size) if paged else (b, position)
                k_hand[where[0], :, where[1]], v_hand[where[0], :, where[1]] = k[b, :, t], v[b, :, t]
        return k_hand, v_hand

    table = None if table is None else jnp.asarray(table)
    call = lambda lens, **kw: module.attention_with_kvcache(
        q, k_cache, v_cache, lens, k=k, v=v, block_table=table, interpret=True, **kw
    )
    k_hand, v_hand = by_hand(lens)
    expected = module.attention_with_kvcache(
        q, k_hand, v_hand, jnp.asarray(lens + tokens), block_table=table, interpret=True
    )
    out, new_k, new_v = call(jnp.asarray(lens))
    np.testing.assert_array_equal(new_k, k_hand)
    np.testing.assert_array_equal(new_v, v_hand)
    np.testing.assert_array_equal(out, expected)
    out, lse, new_k, _ = jax.jit(lambda lens: call(lens, return_lse=True))(jnp.asarray(lens))
    np.testing.assert_array_equal(new_k, k_hand)
    assert lse.shape == (batch, heads, tokens)
    with pytest.raises(ValueError, match="writes positions 11..64; the cache holds 0..63"):
        call(jnp.asarray(lens + 1))
    _, dropped_k, _ = jax.jit(call)(jnp.asarray(lens + 1))  # traced: the token past the pages goes nowhere
    np.testing.assert_array_equal(dropped_k, by_hand(lens + 1)[0])
    with pytest.raises(ValueError, match="together"):
        module.attention_with_kvcache(q, k_cache, v_cache, jnp.asarray(lens), k=k, block_table=table, interpret=True)


_KV_BUFFERS = """
import json, re, sys
from pathlib import Path
from attngen.backends.triton_gpu import TRITON_GPU
from attngen.build import import_generated
from attngen.check.gpu import compile_kernel
module = import_generated(Path(sys.argv[1]), "_attngen_decode_structure")
tile = f"x{module.DECODE_BLOCK_N}x{module.BLOCK_D}xbf16"
decode = TRITON_GPU.kernel("decode")
# One new token, four query heads per kv head (a 16-row tile), split keys: a decode step's launch.
contiguous, paged = module.DECODE_NUM_STAGES, module.DECODE_NUM_STAGES_PAGED
for page_size, stages in ((0, contiguous), (16, contiguous), (16, paged)):
    launch = dict(GROUP=4, BLOCK_M=16, SPLIT=1, PAGE_SIZE=page_size, MERGE_M=4, MERGE_SPLITS=16)
    ir = compile_kernel(module, decode, "bfloat16", 90, num_stages=stages, **launch).asm["ttgir"]
    print(json.dumps(sorted(set(re.findall(r"memdesc<(\\d+)" + tile, ir)))))
"""


def test_a_paged_cache_is_pipelined_as_deep_as_a_contiguous_one():
    """Compiled for sm_90a: Triton's pipeliner gives the block table's load a stage of its own, so at
    the contiguous cache's stages paged K and V would be a buffer shallower (0.86x the contiguous
    bandwidth on an H200); the paged launch's two more stages give them the contiguous depth."""
    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    contiguous, paged_at_contiguous_stages, paged = harness.compiled_structure(_KV_BUFFERS, module.__file__)[-3:]
    assert len(contiguous) == 1 and paged == contiguous
    assert int(paged_at_contiguous_stages[0]) < int(contiguous[0])
