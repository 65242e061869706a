"""The generated Triton kernels compiled for the GPU at hand (not the interpreter), at sizes the
interpreter cannot reach: forward and gradients of a spread of specs, and decoding from a paged
cache. Marked `gpu`: skipped without CUDA; on a GPU machine,

    TRITON_INTERPRET=0 pytest -m gpu -n 4 tests/test_gpu.py
"""

from pathlib import Path

import pytest
import torch

from attngen.exactness import FP8, assert_forward, assert_grads, judge
from attngen.reference import attention_ref_torch
from attngen.spec import load_spec, packed, retarget, with_config
from attngen.testing import example_params, fp8_quantized
from tests import harness

pytestmark = pytest.mark.gpu

SPECS = ["causal", "full", "sliding_window", "document", "alibi_slopes", "softcap", "value_dim"]


def _inputs(spec, batch, heads, q_len, kv_len, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, spec.dtype)
    shapes = ((batch, heads, q_len, spec.head_dim), (batch, heads, kv_len, spec.head_dim))
    shapes += ((batch, heads, kv_len, spec.value_dim), (batch, heads, q_len, spec.value_dim))
    return [torch.randn(s, device="cuda", generator=generator).to(dtype) for s in shapes]


def _params(name, batch, heads, q_len, kv_len, seed):
    params = example_params(name, batch, heads, q_len, kv_len, seed=seed)
    return {k: torch.as_tensor(v, device="cuda") if hasattr(v, "shape") else v for k, v in params.items()}


def _bounds_clear_of_scores(params, spec, q, k):
    """score_cutoff's bounds moved into the widest gap between the scores in [2, 3] of their
    sequence: a score within float32's rounding of its bound may fall on either side in the kernel
    and in float64, which drops a key from one of them and not the other. The gap is ~1e-4 wide at
    the sizes here, float32's rounding of a score ~1e-6."""
    group = q.shape[1] // k.shape[1]
    scores = q.double() @ k.double().repeat_interleave(group, 1).transpose(2, 3) / spec.head_dim**0.5
    bounds = []
    for sequence in scores:
        near = sequence[(sequence > 2.0) & (sequence < 3.0)].sort().values
        widest = int((near[1:] - near[:-1]).argmax())
        bounds.append((near[widest] + near[widest + 1]).item() / 2)
    return {**params, "bound": torch.tensor(bounds, dtype=torch.float32, device=q.device)}


def _grouped_problem(spec, name):
    """The Hopper tests' problem: 2 sequences of 4 heads over 2 kv heads, 1000 queries and 1537 keys
    (odd tails), fresh inputs and params (score_cutoff's bounds clear of the scores): q, k, v, dout, params."""
    batch, heads, kv_heads, q_len, kv_len = 2, 4, 2, 1000, 1537
    q, k, v, dout = _inputs(spec, batch, heads, q_len, kv_len, seed=hash(name) % 2**31)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    params = _params(name, batch, heads, q_len, kv_len, seed=1)
    if name == "score_cutoff":
        params = _bounds_clear_of_scores(params, spec, q, k)
    return q, k, v, dout, params


def _kept_counters(module):
    """The split and tile counters a module keeps per stream for eager calls (_stream_counters)."""
    return [buffer for (_, name), buffer in module._KEPT.items() if name == "counters"]


def _out_and_grads(fn, q, k, v, dout):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = fn(*leaves)
    return out.detach(), lse.detach(), torch.autograd.grad(out, leaves, dout.to(out.dtype))


def _assert_exact(spec, params, inputs, out, lse, grads):
    """Our forward and gradients against float64, by the FlashAttention rule (the reference run in
    the inputs' dtype as the baseline); returns the float64 output and gradients."""
    q, k, v, dout = inputs
    ref_out, ref_lse, ref_grads = _out_and_grads(
        lambda *x: attention_ref_torch(spec, *x, dtype=torch.float64, **params), q, k, v, dout
    )
    base_out, _, base_grads = _out_and_grads(
        lambda *x: attention_ref_torch(spec, *x, dtype=q.dtype, **params), q, k, v, dout
    )
    assert_forward(spec.dtype, out, lse, ref_out, ref_lse, base_out)
    assert_grads(spec.dtype, grads, ref_grads, base_grads)
    return ref_out, ref_grads


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", SPECS)
def test_specs_exact_on_the_gpu(name, dtype):
    spec = harness.with_dtype(load_spec(f"specs/{name}.toml"), dtype)
    module = harness.load_target(spec, "triton_gpu")
    batch, heads, q_len, kv_len = 2, 4, 1537, 2049  # longer than the short-sequence forward, odd tails
    q, k, v, dout = _inputs(spec, batch, heads, q_len, kv_len, seed=hash(name) % 2**31)
    params = _params(name, batch, heads, q_len, kv_len, seed=1)
    out, lse, grads = _out_and_grads(lambda *x: module.attention(*x, return_lse=True, **params), q, k, v, dout)
    _assert_exact(spec, params, (q, k, v, dout), out, lse, grads)


@pytest.mark.parametrize("name", ["causal", "document", "value_dim"])
def test_pointer_tiles_on_the_gpu(name, monkeypatch):
    """The Triton kernels as GPUs without TMA (A100) run them, with their tiles (POINTER_TILES) moved
    through pointers, compiled for this GPU: exact, with grouped kv heads and odd tails."""
    spec = harness.with_dtype(load_spec(f"specs/{name}.toml"), "bfloat16")
    module = harness.load_target(spec, "triton_gpu")
    monkeypatch.setattr(module, "_tma", lambda device: False)
    monkeypatch.setattr(module, "SM90_FORWARD", 0, raising=False)
    monkeypatch.setattr(module, "SM90_BACKWARD", 0, raising=False)
    monkeypatch.setattr(module, "SM90_DQ", 0, raising=False)
    batch, heads, kv_heads, q_len, kv_len = 2, 4, 2, 1537, 2049
    q, k, v, dout = _inputs(spec, batch, heads, q_len, kv_len, seed=5)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    params = _params(name, batch, heads, q_len, kv_len, seed=1)
    out, lse, grads = _out_and_grads(lambda *x: module.attention(*x, return_lse=True, **params), q, k, v, dout)
    _assert_exact(spec, params, (q, k, v, dout), out, lse, grads)


@pytest.mark.parametrize("backward", ["fused", "split"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", sorted(p.stem for p in Path("specs").glob("*.toml")))
def test_the_hopper_kernels_are_exact_for_every_spec(name, dtype, backward):
    """The Gluon forward and backward kernels on an sm90 GPU, with grouped kv heads and odd tails: the
    fused backward, or the dQ and dK/dV kernels (which deterministic calls take); the Triton kernels
    of the same module, in the same run, must not be much more exact than them."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    # Built also where the defaults leave them out (heads of 64), and serving short programs too.
    spec = harness.with_dtype(load_spec(f"specs/{name}.toml"), dtype)
    fused = backward == "fused"
    if fused and max(spec.head_dim, spec.value_dim) > 128:
        pytest.skip("heads wider than 128 build no fused backward")
    hopper = {"sm90_forward": 1, "sm90_backward": 1, "sm90_dq": 1, "sm90_fused_backward": int(fused)}
    short = {"sm90_forward_min_keys": 0, "sm90_fused_min_queries": 0}
    module = harness.load_target(with_config(spec, "triton_gpu", **short, **hopper), "triton_gpu")
    q, k, v, dout, params = _grouped_problem(spec, name)
    assert all(module._runs_sm90(q, switch) for switch in (module.SM90_FORWARD, module.SM90_BACKWARD, module.SM90_DQ))

    def run(*x):
        return module.attention(*x, return_lse=True, **params)

    out, lse, grads = _out_and_grads(run, q, k, v, dout)
    ref_out, ref_grads = _assert_exact(spec, params, (q, k, v, dout), out, lse, grads)
    module.SM90_FORWARD = module.SM90_BACKWARD = module.SM90_DQ = 0  # the Triton kernels, for comparison
    try:
        triton_out, _, triton_grads = _out_and_grads(run, q, k, v, dout)
    finally:
        module.SM90_FORWARD = module.SM90_BACKWARD = module.SM90_DQ = 1
    for ours, theirs, ref in zip((out, *grads), (triton_out, *triton_grads), (ref_out, *ref_grads), strict=True):
        error = (ours.double() - ref).abs().max().item()
        assert error <= 2 * (theirs.double() - ref).abs().max().item() + 1e-6


@pytest.mark.parametrize("name", ["causal", "document", "sinks"])
def test_the_fused_backward_and_its_deterministic_alternative(name):
    """The fused Hopper backward with a gradient for lse as well as for out (its delta, rowsum(dO O) -
    dLSE, from a kernel of its own), against float64 and no less exact than the split kernels;
    under torch.use_deterministic_algorithms the split kernels serve, the same bits in two runs."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    spec = harness.with_dtype(load_spec(f"specs/{name}.toml"), "bfloat16")
    spec = with_config(spec, "triton_gpu", sm90_fused_backward=1, sm90_fused_min_queries=0)
    module = harness.load_target(spec, "triton_gpu")
    q, k, v, dout, params = _grouped_problem(spec, name)
    dlse = torch.randn(q.shape[:3], device=q.device, generator=torch.Generator(q.device).manual_seed(3))

    def grads(fn, *inputs):
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        out, lse = fn(*leaves)
        return torch.autograd.grad((out, lse), leaves, (dout.to(out.dtype), dlse.to(lse.dtype)))

    ref = grads(lambda *x: attention_ref_torch(spec, *x, dtype=torch.float64, **params), q, k, v)
    ours = lambda *x: module.attention(*x, return_lse=True, **params)
    fused = grads(ours, q, k, v)
    torch.use_deterministic_algorithms(True)  # (the split kernels take it from here)
    try:
        split, again = grads(ours, q, k, v), grads(ours, q, k, v)
    finally:
        torch.use_deterministic_algorithms(False)
    for g_fused, g_split, g_again, g_ref in zip(fused, split, again, ref, strict=True):
        assert torch.equal(g_split, g_again)
        error = (g_fused.double() - g_ref).abs().max().item()
        assert 0 < error <= 2 * (g_split.double() - g_ref).abs().max().item() + 1e-6


@pytest.mark.parametrize("name", sorted(p.stem for p in Path("specs").glob("*.toml")))
def test_the_hopper_forward_of_192_queries_is_exact_for_every_spec(name, monkeypatch):
    """sm90_block_m = 192 (bf16 and FP8): three consumer warpgroups, FlashAttention-3's tiles at heads
    of 64, with grouped kv heads, odd tails (1000 queries: five tiles and 40 rows) and each program
    walking some ten tiles (launched as if on a GPU of 5 SMs)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    spec = retarget(load_spec(f"specs/{name}.toml"), 64, "bfloat16")
    tiles = {"sm90_block_m": 192, "sm90_fp8_block_m": 192}
    spec = with_config(spec, "triton_gpu", sm90_forward=1, sm90_forward_min_keys=0, **tiles)
    module = harness.load_target(spec, "triton_gpu")
    monkeypatch.setattr(module, "_sm_count", lambda device: 5)
    q, k, v, dout, params = _grouped_problem(spec, name)
    assert module._runs_sm90(q, module.SM90_FORWARD)
    out, lse, grads = _out_and_grads(lambda *x: module.attention(*x, return_lse=True, **params), q, k, v, dout)
    _assert_exact(spec, params, (q, k, v, dout), out, lse, grads)
    # (FP8's cut-off falls either side of a score within ~1e-3 of its bound: the FP8 test judges
    # score_cutoff's rows clear of it.)
    if name != "score_cutoff":
        results, _ = _fp8_forward(spec, module, q, k, v, k.shape[1], params)
        assert_forward(FP8, *results)


@pytest.mark.parametrize(
    "name, head_dim",
    [("causal", None), ("document", None), ("value_dim", None), ("sinks", None), ("full", 256), ("document", 256)],
)
@pytest.mark.parametrize("dynamic", [0, 1], ids=["static", "dynamic"])
@pytest.mark.parametrize("backward", ["fused", "split"])
def test_the_persistent_hopper_kernels_walk_many_tiles_a_program(name, head_dim, dynamic, backward, monkeypatch):
    """The persistent Hopper kernels: the forward (bf16 and FP8), dQ and dK/dV kernels, each program
    taking every 5th tile or the next from the counter, launched as if on a GPU of 5 SMs so that each
    program walks some 13 (forward, dQ) or 10 (dK/dV) tiles: tiles handed to the consumers, Q's
    (forward), Q's, dO's and O's (dQ) and K's and V's (dK/dV) buffers refilled, barrier phases turned,
    O's tile (at D = 256 through Q's buffer) and dQ's (through Q's) stored again, block tables and sinks
    read per tile; the dynamic walk in L2 sections of 6 (batch, head) pairs (forward and dQ, the last
    one short) and of 2 units (dK/dV). Heads wider than 128 (value_dim's 192 too) take a dK/dV kernel
    of 64 keys a program, and heads of 256 a dQ kernel of 64 queries a program, whose two consumers
    split the columns of dK and dV, or of dQ. The fused backward (heads up to 128) walks the dK/dV
    kernel's tiles, its dQ sums added up in whatever order they come."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    spec = harness.with_dtype(load_spec(f"specs/{name}.toml"), "bfloat16")
    spec = retarget(spec, head_dim, spec.dtype) if head_dim else spec
    fused = backward == "fused"
    if fused and max(spec.head_dim, spec.value_dim) > 128:
        pytest.skip("heads wider than 128 build no fused backward")
    short = {"sm90_forward_min_keys": 0, "sm90_fused_min_queries": 0}
    spec = with_config(spec, "triton_gpu", sm90_forward=1, sm90_fused_backward=int(fused), **short)
    module = harness.load_target(spec, "triton_gpu")
    assert module.SM90_BACKWARD and module.SM90_DQ
    assert module.SM90_DKDV_BLOCK_N == (64 if max(module.BLOCK_D, module.BLOCK_DV) > 128 else 128)
    assert module.SM90_DQ_BLOCK_M == (64 if head_dim == 256 else 128)
    monkeypatch.setattr(module, "SM90_PERSISTENT", 1)  # (exact either way; only the balance differs)
    monkeypatch.setattr(module, "SM90_DYNAMIC", dynamic)
    monkeypatch.setattr(module, "_sm_count", lambda device: 5)
    batch, heads, kv_heads, q_len, kv_len = 2, 4, 2, 1000, 1537  # 64 forward tiles, 52 dK/dV tiles
    q, k, v, dout = _inputs(spec, batch, heads, q_len, kv_len, seed=hash(name) % 2**31)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    kv_head_bytes = kv_len * (module.BLOCK_D + module.BLOCK_DV) * k.element_size()
    monkeypatch.setattr(module, "SM90_L2_BYTES", 3 * kv_head_bytes)  # 3 kv heads: 6 (batch, head) pairs
    assert module._sm90_section(batch * heads, kv_head_bytes, heads // kv_heads) == (6 if dynamic else 1)
    # A dK/dV unit (batch, kv head: 4, the group unsplit at 5 SMs) streams its 2 heads' Q and dO.
    unit_bytes = heads // kv_heads * q_len * (module.BLOCK_D + module.BLOCK_DV) * q.element_size()
    assert module._group_splits(heads // kv_heads, batch * kv_heads * 13, q.device) == 1
    assert module._sm90_section(batch * kv_heads, unit_bytes) == (2 if dynamic else 1)
    params = _params(name, batch, heads, q_len, kv_len, seed=1)
    assert module._runs_sm90(q, module.SM90_FORWARD)
    out, lse, grads = _out_and_grads(lambda *x: module.attention(*x, return_lse=True, **params), q, k, v, dout)
    _assert_exact(spec, params, (q, k, v, dout), out, lse, grads)
    results, _ = _fp8_forward(spec, module, q, k, v, kv_heads, params)
    assert_forward(FP8, *results)
    # The counter walk's kernels (forward, dQ, dK/dV, FP8 forward) share one kept counter on this
    # stream: each launch's last take zeroes it, so the next starts from tile 0 (a shorter call's
    # tiles too, where the params allow one), with the same bits (but the fused backward's dQ, whose
    # float32 sums come in any order: within a few of its ulps).
    for _ in range(2):
        assert not any(counters.any() for counters in _kept_counters(module))
        again = _out_and_grads(lambda *x: module.attention(*x, return_lse=True, **params), q, k, v, dout)
        assert all(torch.equal(a, b) for a, b in zip((out, lse, *grads[1:]), (again[0], again[1], *again[2][1:])))
        dq, dq_again = grads[0].float(), again[2][0].float()
        assert torch.equal(dq, dq_again) or fused and (dq - dq_again).abs().max() <= 4 * 2**-8 * dq.abs().max()
        if not params:
            module.attention(q[:, :, :300], k[:, :, :300], v[:, :, :300])


@pytest.mark.parametrize("head_dim, block_n", [(64, 64), (64, 128), (128, 128)])
def test_the_hopper_dq_kernel_of_64_queries_where_ds_has_its_own_buffers(head_dim, block_n):
    """The Hopper dQ kernel's 64-query blocks (both consumers hold the queries and split dQ's
    columns) at head dims whose O tile cannot hold dS's exchange buffers: they get their own shared
    memory (they overran O's, a wrong dQ at 64 keys a step and an illegal address at 128)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Hopper kernels run on sm90 GPUs only")
    spec = retarget(load_spec("specs/causal.toml"), head_dim, "bfloat16")
    spec = with_config(spec, "triton_gpu", sm90_dq_block_m=64, sm90_dq_block_n=block_n)
    module = harness.load_target(spec, "triton_gpu")
    assert module.SM90_DQ and module.SM90_DQ_BLOCK_M == 64
    q, k, v, dout = _inputs(spec, 2, 4, 1000, 1000, seed=head_dim + block_n)
    out, lse, grads = _out_and_grads(lambda *x: module.attention(*x, return_lse=True), q, k, v, dout)
    _assert_exact(spec, {}, (q, k, v, dout), out, lse, grads)


def _fp8_forward(spec, module, q, k, v, kv_heads, params, per_head=True):
    """attention_fp8 on q, k, v quantized to e4m3 (a descale per batch and kv head, or per tensor),
    with what FlashAttention-3's rule judges it by: ((out, lse, float64 out and lse on the true
    values, a plain FP8 forward's out in bf16), the true q and k)."""
    (q8, q_descale, q), (k8, k_descale, k), (v8, v_descale, v) = (
        fp8_quantized(x.float(), kv_heads, per_head) for x in (q, k, v)
    )
    out, lse = module.attention_fp8(
        q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, return_lse=True, **params
    )
    ref_out, ref_lse = attention_ref_torch(spec, q, k, v, dtype=torch.float64, **params)
    base_out, _ = attention_ref_torch(spec, q, k, v, dtype=torch.float32, fp8_probs=True, **params)
    return (out, lse, ref_out, ref_lse, base_out.bfloat16()), (q, k)


@pytest.mark.parametrize("name", sorted(p.stem for p in Path("specs").glob("*.toml")))
def test_the_fp8_forward_is_exact_for_every_spec(name):
    """attention_fp8 on an sm90 GPU: e4m3 q, k, v with a descale per batch and kv head (per tensor
    for two specs), grouped kv heads, odd tails. Exact by FlashAttention-3's rule: against float64
    on the inputs' true values, at most twice the error of a plain FP8 forward plus bf16's floor."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 forward runs on sm90 GPUs only")
    spec = harness.with_dtype(load_spec(f"specs/{name}.toml"), "bfloat16")
    module = harness.load_target(spec, "triton_gpu")
    batch, heads, kv_heads, q_len, kv_len = 2, 4, 2, 1000, 1537
    q, k, v, _ = _inputs(spec, batch, heads, q_len, kv_len, seed=hash(name) % 2**31)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    per_head = name not in ("causal_bottom_right", "full")
    params = _params(name, batch, heads, q_len, kv_len, seed=1)
    results, (q, k) = _fp8_forward(spec, module, q, k, v, kv_heads, params, per_head)
    assert results[0].dtype == torch.bfloat16
    if name == "score_cutoff":
        # The cut-off is decided on the FP8 product, whose additions keep about 14 bits (errors
        # near 1e-3 here): a score that close to its bound may fall on either side. Judge the rows
        # that have none within 5e-3; they are most of them.
        scores = (q @ k.repeat_interleave(heads // kv_heads, 1).transpose(2, 3)).double() / spec.head_dim**0.5
        bound = params["bound"].double()[:, None, None, None]
        visible = torch.ones(q_len, kv_len, dtype=torch.bool, device="cuda").tril()  # causal, top-left
        clear = ~(((scores - bound).abs() < 5e-3) & visible).any(-1)
        assert clear.float().mean() > 0.5
        results = tuple(x[clear][None, None] for x in results)
    assert_forward(FP8, *results)


@pytest.mark.parametrize(
    "leftpad, tokens",
    [(None, None), ((0, 300, 17, 1500), None), (None, (40, 0, 1, 3))],
    ids=["uniform", "leftpad", "ragged"],
)
def test_decoding_from_a_paged_cache_on_the_gpu(leftpad, tokens):
    """Each sequence's new tokens against its pages (in random order); with left padding
    (cache_leftpad): the sequence from that row on, its positions counted from there; ragged
    (cu_seqlens_q): a chunk of 40 tokens, none, one and three in one launch."""
    spec = load_spec("specs/causal.toml")
    module = harness.load_target(spec, "triton_gpu")
    batch, heads, kv_heads, page_size, pages = 4, 8, 2, 64, 40  # 2560 keys a sequence
    ragged, tokens = tokens is not None, tokens or (3,) * batch
    generator = torch.Generator(device="cuda").manual_seed(0)
    k, v = (torch.randn(batch, kv_heads, pages * page_size, 128, device="cuda", generator=generator) for _ in range(2))
    q = [torch.randn(1, heads, t, 128, device="cuda", generator=generator).bfloat16() for t in tokens]
    lens = torch.tensor([2560, 1000, 64, 2049], dtype=torch.int32, device="cuda")
    order = torch.randperm(batch * pages, device="cuda", generator=generator)
    table = order.view(batch, pages).int()

    def paged(cache):
        out = torch.empty(batch * pages, kv_heads, page_size, 128, device="cuda")
        out[order] = (
            cache.view(batch, kv_heads, pages, page_size, 128).transpose(1, 2).reshape(-1, kv_heads, page_size, 128)
        )
        return out.bfloat16()

    k16, v16 = (x.bfloat16() for x in (k, v))
    starts = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32, device="cuda")
    if not ragged:
        out, lse = module.attention_with_kvcache(
            torch.cat(q), paged(k), paged(v), lens, block_table=table, cache_leftpad=starts, return_lse=True
        )
        rows = [(out[b : b + 1], lse[b : b + 1]) for b in range(batch)]
    else:  # packed [total_q, heads, 128]: each sequence's rows back as [1, heads, T, 128]
        cu = torch.tensor([0, *tokens], device="cuda").cumsum(0).int()
        packed = torch.cat([x[0].transpose(0, 1) for x in q])
        out, lse = module.attention_with_kvcache(
            packed, paged(k), paged(v), lens, block_table=table, cu_seqlens_q=cu, return_lse=True
        )
        rows = [(out[a:z].transpose(0, 1)[None], lse[:, a:z][None]) for a, z in zip(cu[:-1].tolist(), cu[1:].tolist())]
    for b, end in enumerate(lens.tolist()):
        start = 0 if leftpad is None else leftpad[b]
        length = end - start
        causal = (
            torch.arange(length, device="cuda")[None, :]
            <= torch.arange(length - tokens[b], length, device="cuda")[:, None]
        )

        def reference(dtype, b=b, start=start, end=end, causal=causal):
            keys, values = (
                x[b : b + 1, :, start:end].repeat_interleave(heads // kv_heads, 1).to(dtype) for x in (k16, v16)
            )
            scores = (q[b].to(dtype) @ keys.transpose(-1, -2)).double() / 128**0.5
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = torch.softmax(scores, -1)
            return (probs.to(dtype) @ values).double(), torch.logsumexp(scores, -1)

        if tokens[b]:
            ref_out, ref_lse = reference(torch.float64)
            base_out, _ = reference(torch.bfloat16)
            assert_forward("bfloat16", *rows[b], ref_out, ref_lse, base_out)


def test_compiled_decoding_replays_as_a_cuda_graph():
    """attention_with_kvcache inside torch.compile(mode="reduce-overhead"): inductor captures the
    step (pages, packed new tokens) in a CUDA graph and replays it; each replay equals an eager call
    on the same inputs, lengths changed in place between steps. An append under capture is refused
    with its reason (it checks positions on the host)."""
    module = harness.load_target(load_spec("specs/causal.toml"), "triton_gpu")
    generator = torch.Generator(device="cuda").manual_seed(3)
    heads, kv_heads, page_size, pages = 32, 8, 16, 512
    k_cache, v_cache = (
        torch.randn(pages, kv_heads, page_size, 128, device="cuda", generator=generator).bfloat16() for _ in range(2)
    )
    table = torch.randperm(pages, device="cuda", generator=generator).view(4, -1).int()
    cu = torch.tensor([0, 1, 5, 6, 22], dtype=torch.int32, device="cuda")
    q = torch.randn(22, heads, 128, device="cuda", generator=generator).bfloat16()
    lens = torch.tensor([2000, 1500, 17, 900], dtype=torch.int32, device="cuda")

    def step(q, lens):
        return module.attention_with_kvcache(q, k_cache, v_cache, lens, block_table=table, cu_seqlens_q=cu)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    for _ in range(4):  # (warm-up, capture, replays)
        lens += 7
        assert torch.equal(compiled(q, lens).clone(), step(q, lens))
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="appends only outside CUDA-graph capture"), torch.cuda.graph(graph):
        module.attention_with_kvcache(
            q, k_cache, v_cache, lens, k=q[:, :kv_heads], v=q[:, :kv_heads], block_table=table, cu_seqlens_q=cu
        )


def test_decoding_from_an_fp8_cache_on_the_gpu():
    """An FP8 paged cache (e4m3, a factor per sequence and kv head, as vLLM keeps it) against its
    true values (e4m3 times factor) in float64, ragged new tokens and splits on the H200."""
    spec = load_spec("specs/sliding_window.toml")
    module = harness.load_target(spec, "triton_gpu")
    batch, heads, kv_heads, page_size, pages, window = 3, 8, 2, 16, 160, 1000  # 2560 keys a sequence
    generator = torch.Generator(device="cuda").manual_seed(3)
    order = torch.randperm(batch * pages, device="cuda", generator=generator)  # page i of the pool at slot order[i]
    table = order.view(batch, pages).int()
    true, cached, factors = [], [], []
    for _ in "kv":
        x = torch.randn(batch, kv_heads, pages * page_size, 128, device="cuda", generator=generator)
        factor = x.abs().amax(dim=(2, 3)) / 448
        e4m3 = (x / factor[:, :, None, None]).to(torch.float8_e4m3fn).float()  # (its values, exactly)
        true.append(e4m3.double() * factor[:, :, None, None])
        in_order = (
            e4m3.view(batch, kv_heads, pages, page_size, 128).transpose(1, 2).reshape(-1, kv_heads, page_size, 128)
        )
        cached.append(in_order[torch.argsort(order)].to(torch.float8_e4m3fn))
        factors.append(factor)
    k_pages, v_pages = cached
    tokens, lens = [5, 1, 0], torch.tensor([2560, 700, 9], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *tokens], device="cuda").cumsum(0).int()
    q = torch.randn(sum(tokens), heads, 128, device="cuda", generator=generator).bfloat16()
    out, lse = module.attention_with_kvcache(
        q, k_pages, v_pages, lens, block_table=table, cu_seqlens_q=cu, k_descale=factors[0], v_descale=factors[1],
        return_lse=True, window=window,
    )  # fmt: skip
    for b, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == z:
            continue
        length = int(lens[b])
        position = torch.arange(length - (z - a), length, device="cuda")[:, None]
        key = torch.arange(length, device="cuda")[None, :]
        visible = (key <= position) & (position - key < window)

        def reference(dtype, b=b, a=a, z=z, length=length, visible=visible):
            keys, values = (x[b : b + 1, :, :length].repeat_interleave(heads // kv_heads, 1).to(dtype) for x in true)
            scores = (q[a:z].transpose(0, 1)[None].to(dtype) @ keys.transpose(-1, -2)).double() / 128**0.5
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
            return (probs.to(dtype) @ values).double(), torch.logsumexp(scores.masked_fill(~visible, float("-inf")), -1)

        ref_out, ref_lse = reference(torch.float64)
        base_out, _ = reference(torch.bfloat16)
        assert_forward("bfloat16", out[a:z].transpose(0, 1)[None], lse[:, a:z][None], ref_out, ref_lse, base_out)

    # Replayed from a CUDA graph, as engines decode: the same bits, with factors as tensors or numbers.
    for k_descale, v_descale in ((factors[0], factors[1]), (0.5, 0.25)):
        call = lambda k_descale=k_descale, v_descale=v_descale: module.attention_with_kvcache(
            q, k_pages, v_pages, lens, block_table=table, cu_seqlens_q=cu, k_descale=k_descale, v_descale=v_descale,
            window=window,
        )  # fmt: skip
        expected = call()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            call()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = call()
        graph.replay()
        torch.testing.assert_close(replayed, expected, rtol=0, atol=0)


def test_the_last_split_merges_exactly_and_repeatably_on_the_gpu():
    """Split-KV: the last program of a tile to finish merges every split's partial output. Whichever
    it is, the result is the same bits (20 calls each, many splits finishing together; every other
    call reuses one workspace, which the last splits zero again) and exact."""
    spec = load_spec("specs/causal.toml")
    module = harness.load_target(spec, "triton_gpu")
    batch, heads, kv_heads, length = 3, 16, 4, 4096
    generator = torch.Generator(device="cuda").manual_seed(7)
    k, v = (
        torch.randn(batch, kv_heads, length, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
        for _ in range(2)
    )
    q = torch.randn(batch, heads, 2, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
    lens = torch.tensor([4096, 3000, 130], dtype=torch.int32, device="cuda")  # the last: most splits empty
    causal = load_spec("specs/causal.toml")
    for num_splits in (2, 7, 32, 128):
        workspace = module.kvcache_workspace("cuda")
        runs = [
            module.attention_with_kvcache(
                q, k, v, lens, num_splits=num_splits, return_lse=True, workspace=workspace if run % 2 else None
            )
            for run in range(20)
        ]
        assert not workspace.any()
        assert not any(counters.any() for counters in _kept_counters(module))  # the kept ones (no workspace)
        for out, lse in runs[1:]:
            assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])
        # Without return_lse the LSE goes to the stream's kept scratch, as the partial outputs do.
        assert torch.equal(module.attention_with_kvcache(q, k, v, lens, num_splits=num_splits), runs[0][0])
        out, lse = runs[0]
        for b, n in enumerate(lens.tolist()):
            keys, values = (x[b : b + 1, :, :n].repeat_interleave(heads // kv_heads, 1) for x in (k, v))
            queries = torch.cat([torch.zeros_like(q[b : b + 1, :, :1]).expand(-1, -1, n - 2, -1), q[b : b + 1]], 2)
            ref_out, ref_lse = attention_ref_torch(causal, queries, keys, values, dtype=torch.float64)
            base_out, _ = attention_ref_torch(causal, queries, keys, values, dtype=torch.bfloat16)
            tail = slice(n - 2, n)
            assert_forward(
                "bfloat16",
                out[b : b + 1],
                lse[b : b + 1],
                ref_out[:, :, tail],
                ref_lse[:, :, tail],
                base_out[:, :, tail],
            )


def test_tensors_of_more_than_2_31_elements():
    """q, k, v of 2.15e9 elements each (training) and a KV cache of 2.16e9 (decoding): offsets past
    2**31 are int64 in every kernel; the last sequences, whose elements all lie past 2**31, exact."""
    spec = load_spec("specs/causal.toml")
    module = harness.load_target(spec, "triton_gpu")
    batch, seq = 16400, 1024  # 16400 * 1024 * 128 = 2.15e9 > 2**31
    q, k, v, dout = _inputs(spec, batch, 1, seq, seq, seed=31)
    assert q.numel() > 2**31
    out, lse, grads = _out_and_grads(lambda *x: module.attention(*x, return_lse=True), q, k, v, dout)
    tail = slice(batch - 2, batch)
    _assert_exact(spec, {}, [x[tail] for x in (q, k, v, dout)], out[tail], lse[tail], [g[tail] for g in grads])
    del q, k, v, dout, out, lse, grads

    batch, heads, kv_heads, length = 64, 32, 8, 33000  # 64 * 8 * 33000 * 128 = 2.16e9
    generator = torch.Generator(device="cuda").manual_seed(32)
    k_cache, v_cache = (
        torch.randn(batch, kv_heads, length, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
        for _ in range(2)
    )
    assert k_cache.numel() > 2**31
    q = torch.randn(batch, heads, 1, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
    lens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
    out, lse = module.attention_with_kvcache(q, k_cache, v_cache, lens, return_lse=True)
    last = slice(batch - 1, batch)  # one new token sees every cached key: causal = full here
    keys, values = (x[last].repeat_interleave(heads // kv_heads, 1) for x in (k_cache, v_cache))
    ref_out, ref_lse = attention_ref_torch(load_spec("specs/full.toml"), q[last], keys, values, dtype=torch.float64)
    base_out, _ = attention_ref_torch(load_spec("specs/full.toml"), q[last], keys, values, dtype=torch.bfloat16)
    assert_forward("bfloat16", out[last], lse[last], ref_out, ref_lse, base_out)


def test_a_launch_bound_once_takes_a_kernel_compiled_for_arguments_like_its_own():
    """Eager calls launch a kernel compiled for earlier arguments only where Triton would have picked
    it too (_launch): after an aligned q and a cache of 1024 keys, a q 2 bytes off 16-byte alignment
    and a cache of 1000 keys (lengths and strides no multiple of 16) each take a kernel of their own,
    exact, and a repeated call reuses its kernel, bit for bit."""
    spec = load_spec("specs/causal.toml")
    module = harness.load_target(spec, "triton_gpu")
    module._LAUNCHES.clear()
    full = load_spec("specs/full.toml")
    generator = torch.Generator(device="cuda").manual_seed(5)
    batch, heads, kv_heads = 2, 8, 2
    outputs = []
    for length, offset in ((1024, 0), (1024, 1), (1000, 0), (1024, 0)):
        k, v = (
            torch.randn(batch, kv_heads, length, 128, device="cuda", generator=generator, dtype=torch.bfloat16)
            for _ in range(2)
        )
        storage = torch.randn(batch * heads * 128 + offset, device="cuda", generator=generator, dtype=torch.bfloat16)
        q = storage[offset:].view(batch, heads, 1, 128)
        assert (q.data_ptr() % 16 == 0) == (offset == 0)
        lens = torch.tensor([length, length - 3], dtype=torch.int32, device="cuda")
        out, lse = module.attention_with_kvcache(q, k, v, lens, return_lse=True)
        for b, n in enumerate(lens.tolist()):  # one new token sees every key of its sequence
            keys, values = (x[b : b + 1, :, :n].repeat_interleave(heads // kv_heads, 1) for x in (k, v))
            ref_out, ref_lse = attention_ref_torch(full, q[b : b + 1], keys, values, dtype=torch.float64)
            base_out, _ = attention_ref_torch(full, q[b : b + 1], keys, values, dtype=torch.bfloat16)
            assert_forward("bfloat16", out[b : b + 1], lse[b : b + 1], ref_out, ref_lse, base_out)
        outputs.append((q, k, v, lens, out))
        decode_kernels = [key for key in module._LAUNCHES if key[0] is module._decode_fwd]
        assert len(decode_kernels) == min(len(outputs), 3)
    q, k, v, lens, out = outputs[-1]
    assert torch.equal(module.attention_with_kvcache(q, k, v, lens), out)


@pytest.mark.parametrize("name", ["causal", "alibi_slopes"])
def test_non_finite_inputs_on_the_gpu(name):
    """NaN in q, +-inf or NaN in k: non-finite exactly where the float64 reference is, the other
    rows exact; NaN in v: NaN in every row that sees it (README, Semantics)."""
    spec = load_spec(f"specs/{name}.toml")
    module = harness.load_target(spec, "triton_gpu")
    q, k, v, _ = _inputs(spec, 1, 2, 700, 700, seed=33)
    params = _params(name, 1, 2, 700, 700, seed=1)
    for which, row, value in (
        ("q", 5, float("nan")),
        ("k", 300, float("inf")),
        ("k", 300, float("-inf")),
        ("k", 300, float("nan")),
    ):
        x = {"q": q.clone(), "k": k.clone(), "v": v}
        x[which][0, 1, row, :4] = value
        out, lse = module.attention(x["q"], x["k"], x["v"], return_lse=True, **params)
        ref_out, ref_lse = attention_ref_torch(spec, x["q"], x["k"], x["v"], dtype=torch.float64, **params)
        base_out, _ = attention_ref_torch(spec, x["q"], x["k"], x["v"], dtype=q.dtype, **params)
        broken = ~ref_out.isfinite().all(-1)
        assert broken.any(), "the case must reach the softmax"
        assert torch.equal(~out.isfinite().all(-1), broken), f"{which} = {value}: non-finite rows"
        assert torch.equal(~lse.isfinite(), ~ref_lse.isfinite()), f"{which} = {value}: non-finite LSE"
        assert_forward(
            spec.dtype,
            out[~broken][None],
            lse[~broken][None],
            ref_out[~broken][None],
            ref_lse[~broken][None],
            base_out[~broken][None],
        )
    x = v.clone()
    x[0, 0, 300, 0] = float("nan")
    out = module.attention(q, k, x, **params)
    assert out[0, 0, 300:, 0].isnan().all(), "rows that see the value are NaN in its column"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_sinks_on_the_gpu(head_dim):
    """specs/sinks.toml (bf16; the Hopper kernels at both head dims): out, lse and the gradients of
    q, k, v and the sinks against float64, by the FlashAttention rule; the sinks' gradient bitwise
    the same in a second run."""
    spec = with_config(
        retarget(load_spec("specs/sinks.toml"), head_dim, "bfloat16"),
        "triton_gpu",
        sm90_forward=1,
        sm90_backward=1,
        sm90_dq=1,
    )
    module = harness.load_target(spec, "triton_gpu")
    batch, heads, kv_heads, q_len = 2, 8, 2, 3001
    q, k, v, dout = _inputs(spec, batch, heads, q_len, q_len, seed=head_dim)
    k, v = k[:, :kv_heads], v[:, :kv_heads]
    sinks = 2 * torch.randn(heads, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))

    def grads(fn, dtype):  # the sinks stay float32 (float64 for the reference), as a model keeps them
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        leaves.append(sinks.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_())
        out, lse = fn(*leaves)
        return out.detach(), lse.detach(), torch.autograd.grad((out * dout.to(out.dtype)).sum(), leaves)

    ours = lambda q, k, v, s: module.attention(q, k, v, sinks=s, return_lse=True)
    reference = lambda q, k, v, s: attention_ref_torch(spec, q, k, v, sinks=s, dtype=q.dtype)
    out, lse, ours_grads = grads(ours, q.dtype)
    ref_out, ref_lse, ref_grads = grads(reference, torch.float64)
    base_out, _, base_grads = grads(reference, q.dtype)
    assert all(module._runs_sm90(q, switch) for switch in (module.SM90_FORWARD, module.SM90_BACKWARD, module.SM90_DQ))
    assert_forward(spec.dtype, out, lse, ref_out, ref_lse, base_out)
    names = ("dq", "dk", "dv", "dsinks")
    assert_grads(spec.dtype, dict(zip(names, ours_grads)), dict(zip(names, ref_grads)), dict(zip(names, base_grads)))
    assert torch.equal(grads(ours, q.dtype)[2][3], ours_grads[3])


def test_varlen_on_the_gpu():
    """attention_varlen of causal_bottom_right's packed form (bf16, D = 128: the Hopper kernels
    walking block tables) at real sizes: 9 sequences of unequal query and key lengths, one empty,
    forward and gradients against the spec over each sequence alone in float64."""
    spec = load_spec("specs/causal_bottom_right.toml")
    module = harness.load_target(packed(spec), "triton_gpu")
    g = torch.Generator().manual_seed(9)
    lengths_k = torch.randint(1, 2000, (9,), generator=g)
    lengths_q = torch.minimum(lengths_k, torch.randint(0, 2000, (9,), generator=g))
    lengths_q[4] = 0
    cu = [torch.cat([torch.zeros(1, dtype=torch.int64), x.cumsum(0)]).int().cuda() for x in (lengths_q, lengths_k)]
    heads, kv_heads = 8, 2
    q = torch.randn(int(lengths_q.sum()), heads, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(int(lengths_k.sum()), kv_heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)

    def reference(q, k, v, dtype):
        outs = []
        for s in range(9):
            rows, keys = slice(cu[0][s], cu[0][s + 1]), slice(cu[1][s], cu[1][s + 1])
            one = [x[None].transpose(1, 2) for x in (q[rows], k[keys], v[keys])]
            outs.append(attention_ref_torch(spec, *one, dtype=dtype)[0][0].transpose(0, 1))
        return torch.cat(outs)

    def grads(fn, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        return out.detach(), torch.autograd.grad((out * dout.to(out.dtype)).sum(), leaves)

    out, ours = grads(lambda q, k, v: module.attention_varlen(q, k, v, *cu), torch.bfloat16)
    ref_out, ref = grads(lambda q, k, v: reference(q, k, v, torch.float64), torch.float64)
    base_out, base = grads(lambda q, k, v: reference(q, k, v, torch.bfloat16), torch.bfloat16)
    assert module._runs_sm90(q[None].transpose(1, 2), module.SM90_FORWARD)
    errors = {"out": (out.double() - ref_out).abs().max().item()}
    verdict = judge("bfloat16", errors, {"out": (base_out.double() - ref_out).abs().max().item()})
    assert verdict.ok, verdict.message
    assert_grads("bfloat16", ours, ref, base)


def test_calls_on_a_gpu_other_than_the_current_one():
    """A model split over GPUs calls attention on its second GPU while the first is current (PyTorch's
    own kernels follow their tensors): the forward, backward and decode launch on the tensors' GPU,
    exact."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    spec = load_spec("specs/causal.toml")
    module = harness.load_target(spec, "triton_gpu")
    torch.cuda.set_device(0)
    with torch.cuda.device(1):
        q, k, v, dout = _inputs(spec, 2, 4, 700, 700, seed=3)
    assert q.device.index == 1 and torch.cuda.current_device() == 0
    out, lse, grads = _out_and_grads(lambda *x: module.attention(*x, return_lse=True), q, k, v, dout)
    assert out.device.index == 1 and all(g.device.index == 1 for g in grads)
    _assert_exact(spec, {}, (q, k, v, dout), out, lse, grads)
    # (autograd ran the backward with GPU 1 current, as it does each device's; called directly:)
    direct = module.attention_backward(dout, None, q, k, v, out, lse)
    assert all(torch.equal(a, b) for a, b in zip(direct, grads))
    lens = torch.tensor([700, 333], dtype=torch.int32, device=q.device)
    new = q[:, :, -2:]
    out, lse = module.attention_with_kvcache(new, k, v, lens, return_lse=True)
    assert out.device.index == 1 and torch.cuda.current_device() == 0
    for b, n in enumerate(lens.tolist()):  # the new tokens are the last 2 of each sequence's n
        queries = torch.cat([q[b : b + 1, :, : n - 2], new[b : b + 1]], 2)
        keys, values = k[b : b + 1, :, :n], v[b : b + 1, :, :n]
        ref_out, ref_lse = attention_ref_torch(spec, queries, keys, values, dtype=torch.float64)
        base_out, _ = attention_ref_torch(spec, queries, keys, values, dtype=torch.bfloat16)
        tail = slice(n - 2, n)
        assert_forward(
            "bfloat16", out[b : b + 1], lse[b : b + 1], ref_out[:, :, tail], ref_lse[:, :, tail], base_out[:, :, tail]
        )


CONTEXT_PARALLEL = [
    ("causal", "ring", "zigzag"),
    ("sliding_window", "ring", "contiguous"),
    ("document", "allgather", "zigzag"),
]
CP_HEADS, CP_KV_HEADS, CP_LENGTH = 8, 2, 4097  # GQA; a length two ranks cannot split evenly


def _cp_problem(name):
    spec = load_spec(f"specs/{name}.toml")
    generator = torch.Generator(device="cuda").manual_seed(3)
    shapes = [(1, CP_HEADS, CP_LENGTH, spec.head_dim), *[(1, CP_KV_HEADS, CP_LENGTH, spec.head_dim)] * 2]
    q, k, v, dout = (
        torch.randn(s, device="cuda", generator=generator).to(torch.bfloat16) for s in [*shapes, shapes[0]]
    )
    return spec, (q, k, v, dout), _params(name, 1, CP_HEADS, CP_LENGTH, CP_LENGTH, seed=3)


def _cp_rank(rank, world, port, out_dir):
    import os

    import torch.distributed as dist

    from attngen.parallel.torch_distributed import ContextParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)  # NCCL refuses two ranks on one GPU
    for name, mode, layout in CONTEXT_PARALLEL:
        spec, (q, k, v, dout), params = _cp_problem(name)
        cp = ContextParallel(spec, mode=mode, layout=layout)
        leaves = [cp.shard(x).requires_grad_() for x in (q, k, v)]
        out, lse = cp.attention(*leaves, return_lse=True, **params)
        (out.float() * cp.shard(dout)).sum().backward()
        got = [cp.unshard(t.detach()).cpu() for t in (out, lse, *(x.grad for x in leaves))]
        if rank == 0:
            torch.save(got, f"{out_dir}/{name}.pt")
    dist.destroy_process_group()


def test_context_parallel_over_two_processes_on_the_gpu(tmp_path):
    """attngen.parallel's ring and all-gather over two gloo processes sharing this GPU: the GPU
    kernels (Hopper ones on an H200) on sharded bf16 sequences, exact by the same rule."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_cp_rank, args=(2, port, str(tmp_path)), nprocs=2)
    for name, _, _ in CONTEXT_PARALLEL:
        spec, inputs, params = _cp_problem(name)
        out, lse, *grads = (t.cuda() for t in torch.load(tmp_path / f"{name}.pt"))
        _assert_exact(spec, params, inputs, out, lse, grads)


TRAINED_BIAS = """
name = "trained_bias"
head_dim = 128
dtype = "bfloat16"

[mask]
causal = true

[score]
expr = "score + slopes[h] * (kv_idx - q_idx) + bias[b, h, q_idx, kv_idx] + rel[h, (q_idx - kv_idx) // 16 + 40]"

[params]
slopes = "float[heads]"
bias = "float[batch, heads, q_len, kv_len]"
rel = "float[heads, buckets]"

[grad]
params = ["slopes", "bias", "rel"]

# As specs/bias.toml: a float32 tile of the bias beside every score tile takes shared memory.
[triton]
block_n = 64
num_stages = 2
dkdv_num_stages = 2
dq_num_stages = 2
"""


def test_trained_params_on_the_gpu():
    """[grad] params on the GPU (the dQ kernel gathers them; on an H200 beside the Hopper dK/dV
    kernel): a per-head slope, a full additive bias and a bucketed relative table (its far
    distances clamped) exact by the FlashAttention rule against float64 (the reference in bf16 as
    the baseline), and bitwise the same on a second backward."""
    from attngen.spec import parse_spec

    spec = parse_spec(TRAINED_BIAS, "trained_bias.toml")
    module = harness.load_target(spec, "triton_gpu")
    batch, heads, length = 2, 8, 1537
    q, k, v, dout = _inputs(spec, batch, heads, length, length, seed=9)
    generator = torch.Generator(device="cuda").manual_seed(9)
    params = {
        "slopes": 0.05 * torch.rand(heads, device="cuda", generator=generator),
        "bias": torch.randn(batch, heads, length, length, device="cuda", generator=generator),
        "rel": torch.randn(heads, 81, device="cuda", generator=generator),
    }

    def grads(fn, dtype=None):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        trained = {
            n: t.detach().clone().double().requires_grad_()
            if dtype is torch.float64
            else t.detach().clone().requires_grad_()
            for n, t in params.items()
        }
        out = fn(*leaves, **trained)
        (out.float() * dout.float()).sum().backward()
        return out.detach(), [x.grad for x in leaves] + [trained[n].grad for n in ("slopes", "bias", "rel")]

    out, ours = grads(lambda *x, **p: module.attention(*x, **p))
    _, again = grads(lambda *x, **p: module.attention(*x, **p))
    assert all(torch.equal(a, b) for a, b in zip(ours, again)), "a second backward differs"
    ref_out, ref = grads(lambda *x, **p: attention_ref_torch(spec, *x, dtype=torch.float64, **p)[0], torch.float64)
    base_out, base = grads(lambda *x, **p: attention_ref_torch(spec, *x, dtype=torch.bfloat16, **p)[0])
    names = ("out", "dq", "dk", "dv", "dslopes", "dbias", "drel")  # (out judged as an output, the rest as gradients)
    judged = lambda out, grads: dict(zip(names, [out, *grads]))
    assert_grads("bfloat16", judged(out, ours), judged(ref_out, ref), judged(base_out, base))
