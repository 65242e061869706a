"""Context parallelism (attngen.parallel) on CPU, exact against float64 attention of the whole sequence.

torch: world sizes 2 and 4 as gloo processes running the Triton kernels in the interpreter. JAX:
2 and 4 forced host devices (a subprocess: XLA reads the flag at start) running the Pallas kernels
in interpret mode. Forward and backward; causal, full, sliding window, document and ALiBi specs;
ring and all-gather modes over zigzag and contiguous layouts; a sequence length divisible by
neither world. Small tiles (16) so that shards span several tiles and the offsets move tile bounds.
"""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attngen.errors import SpecError
from attngen.exactness import assert_forward, assert_grads
from attngen.parallel import ShardedSpec, chunk_sizes, global_length, local_length, pieces
from attngen.reference import attention_ref_torch
from attngen.spec import load_spec, parse_spec, retarget, with_config

LENGTH, HEADS, KV_HEADS, DIM = 75, 4, 2, 32
# (spec, mode, layout) per world size: every mode and layout, alone and together, appears in each
# target's run, with masks of closed-form bounds and of block tables, a score, sinks, trained params.
CASES = {
    2: [
        ("document", "allgather", "zigzag"),
        ("sinks", "ring", "zigzag"),  # causal, with a sink
        ("relative_bias_trained", "ring", "zigzag"),  # a trained relative table: summed along diagonals
    ],
    4: [
        ("sliding_window", "ring", "contiguous"),
        ("full", "allgather", "contiguous"),
        ("alibi_slopes", "ring", "zigzag"),  # trained slopes: each rank's (device's) share summed
    ],
}


def small(name):
    if name == "relative_bias_trained":  # specs/relative_bias.toml, its table trained
        text = Path("specs/relative_bias.toml").read_text() + '\n[grad]\nparams = ["rel_bias"]\n'
        spec = retarget(parse_spec(text, "relative_bias_trained.toml"), DIM, "float32")
    else:
        spec = retarget(load_spec(f"specs/{name}.toml"), DIM, "float32")
    spec = with_config(spec, "triton_gpu", block_m=16, block_n=16, dq_block_m=16, dq_block_n=16,
                       dkdv_block_m=16, dkdv_block_n=16, short_block_m=16, short_block_n=16)  # fmt: skip
    return with_config(spec, "pallas_tpu", block_q=16, block_kv=128)


def problem(name):
    """q, k, v, the output's cotangent and the spec's params, the same in every process."""
    g = torch.Generator().manual_seed(7)
    q, do = (torch.randn(1, HEADS, LENGTH, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(1, KV_HEADS, LENGTH, DIM, generator=g) for _ in range(2))
    params = {"sliding_window": {"window": 19}}.get(name, {})
    if name == "sinks":
        params = {"sinks": 2 * torch.randn(HEADS, generator=g)}
    if name == "alibi_slopes":
        params = {"slopes": torch.rand(HEADS, generator=g)}
    if name == "relative_bias_trained":  # distances past 10 clamp to the table's ends
        params = {"rel_bias": torch.randn(HEADS, 21, generator=g), "max_dist": 10}
    if name == "document":  # documents cross the shard borders
        seg = torch.tensor(np.repeat(np.arange(5), [10, 30, 5, 20, 10]), dtype=torch.int32)[None]
        params = {"seg_q": seg, "seg_kv": seg}
    return q, k, v, do, params


def judge(name, got):
    """Each result (whole sequence, float32) against the float64 reference."""
    spec = small(name)
    q, k, v, do, params = problem(name)
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    params = {
        n: t.double().requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t for n, t in params.items()
    }
    ref_out, ref_lse = attention_ref_torch(spec, qr, kr, vr, **params)
    (ref_out * do.double()).sum().backward()
    assert_forward("float32", got["out"], got["lse"], ref_out.detach().numpy(), ref_lse.detach().numpy())
    names = ["dq", "dk", "dv", *(f"d{n}" for n, t in params.items() if torch.is_tensor(t) and t.requires_grad)]
    refs = [qr.grad, kr.grad, vr.grad, *(t.grad for t in params.values() if torch.is_tensor(t) and t.requires_grad)]
    assert_grads("float32", {n: got[n] for n in names}, dict(zip(names, refs)))


# --------------------------------------------------------------------------- torch, gloo


def _torch_rank(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    from attngen.parallel.torch_distributed import ContextParallel

    dist.init_process_group("gloo", rank=rank, world_size=world)
    for name, mode, layout in CASES[world]:
        cp = ContextParallel(small(name), mode=mode, layout=layout)
        q, k, v, do, params = problem(name)
        ql, kl, vl = (cp.shard(x).requires_grad_() for x in (q, k, v))
        params = {
            n: t.requires_grad_() if torch.is_tensor(t) and t.is_floating_point() else t for n, t in params.items()
        }
        out, lse = cp.attention(ql, kl, vl, return_lse=True, **params)
        (out * cp.shard(do)).sum().backward()
        got = {"out": out, "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        got = {n: cp.unshard(t.detach()).numpy() for n, t in got.items()}
        for n, t in params.items():  # a parameter's gradient is each rank's part: summed as DDP does
            if torch.is_tensor(t) and t.requires_grad:
                dist.all_reduce(t.grad)
                got[f"d{n}"] = t.grad.numpy()
        if rank == 0:
            np.savez(Path(out_dir) / f"{name}-{mode}-{layout}.npz", **got)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", sorted(CASES))
def test_torch_gloo_ranks_are_exact(world, tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "cache"))
    mp.spawn(_torch_rank, args=(world, _free_port(), str(tmp_path)), nprocs=world)
    for name, mode, layout in CASES[world]:
        judge(name, dict(np.load(tmp_path / f"{name}-{mode}-{layout}.npz")))


def test_a_world_of_one_is_the_whole_kernel(tmp_path, monkeypatch):
    import torch.distributed as dist

    from attngen.parallel.torch_distributed import ContextParallel

    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "cache"))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for mode in ("ring", "allgather"):
            cp = ContextParallel(small("causal"), mode=mode)
            q, k, v, do, _ = problem("causal")
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            out = cp.attention(*leaves)
            (out * do).sum().backward()
            judge("causal", {"out": out.detach().numpy(), "lse": cp.attention(q, k, v, return_lse=True)[1].numpy(),
                             **{n: x.grad.numpy() for n, x in zip(("dq", "dk", "dv"), leaves)}})  # fmt: skip
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- JAX, shard_map


def _jax_devices(world, out_dir):
    import jax
    import jax.numpy as jnp

    from attngen.parallel.jax_shard_map import ContextParallel

    mesh = jax.make_mesh((world,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
    for name, mode, layout in CASES[world]:
        cp = ContextParallel(small(name), mesh, "seq", mode=mode, layout=layout, interpret=True)
        q, k, v, do, params = (jnp.asarray(x.numpy()) if isinstance(x, torch.Tensor) else x for x in problem(name))
        params = {n: jnp.asarray(t.numpy()) if isinstance(t, torch.Tensor) else t for n, t in params.items()}
        # Float tensor params (a sink's) are differentiated too; the others are constants.
        floats = {n: t for n, t in params.items() if hasattr(t, "dtype") and jnp.issubdtype(t.dtype, jnp.floating)}
        others = {n: t for n, t in params.items() if n not in floats}

        def loss(q, k, v, floats, cp=cp, others=others, do=do):
            out, lse = cp.attention(q, k, v, return_lse=True, **floats, **others)
            return (out * do).sum(), (out, lse)

        (_, (out, lse)), (dq, dk, dv, d_floats) = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
            q, k, v, floats
        )
        got = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, **{f"d{n}": g for n, g in d_floats.items()}}
        np.savez(Path(out_dir) / f"{name}-{mode}-{layout}.npz", **got)


@pytest.mark.parametrize("world", sorted(CASES))
def test_jax_shard_map_devices_are_exact(world, tmp_path):
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={world}",
        "JAX_PLATFORMS": "cpu",
        "ATTNGEN_CACHE_DIR": str(tmp_path / "cache"),
    }
    root = Path(__file__).parent.parent
    run = subprocess.run(
        [sys.executable, "-m", "tests.test_parallel", str(world), str(tmp_path)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    for name, mode, layout in CASES[world]:
        judge(name, dict(np.load(tmp_path / f"{name}-{mode}-{layout}.npz")))


# --------------------------------------------------------------------------- layouts and skipping


def test_layouts_cut_the_sequence_into_the_rank_pieces():
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert pieces(10, 2, 0, "contiguous") == [(0, 5)] and pieces(10, 2, 1, "contiguous") == [(5, 5)]
    # zigzag over 2 ranks: chunks 0 and 3 to rank 0, chunks 1 and 2 to rank 1
    assert pieces(10, 2, 0, "zigzag") == [(0, 3), (8, 2)] and pieces(10, 2, 1, "zigzag") == [(3, 3), (6, 2)]
    for world in (1, 2, 3, 4):
        for layout in ("contiguous", "zigzag"):
            held = sorted(p for r in range(world) for p in pieces(75, world, r, layout))
            assert sum(size for _, size in held) == 75
            assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(held))  # every position once
            assert global_length([local_length(75, world, r, layout) for r in range(world)], layout) == 75
    with pytest.raises(ValueError, match="not a zigzag layout"):
        global_length([40, 35, 1], "zigzag")


def test_hidden_block_pairs_are_skipped_whole():
    """visits(): False only where the mask hides every pair, by brute force over small blocks; the
    JAX ring's answer (jax.numpy, as traced offsets take it) is the same."""
    import jax.numpy as jnp

    from attngen.reference import dense_mask

    for name, params in [
        ("causal", {}),
        ("sliding_window", {"window": 19}),
        ("chunked", {"chunk": 16}),
        ("prefix_lm", {"prefix": 30}),
    ]:
        spec = small(name)
        sharded = ShardedSpec.of(spec)
        visible = dense_mask(spec, 1, 1, LENGTH, LENGTH, params)[0, 0]
        blocks = [(start, 10) for start in range(0, 70, 10)]
        skipped = 0
        for q in blocks:
            for kv in blocks:
                seen = visible[q[0] : q[0] + q[1], kv[0] : kv[0] + kv[1]].any()
                visits = sharded.visits(q, kv, (LENGTH, LENGTH), params)
                assert visits or not seen, (name, q, kv)
                offsets = (jnp.int32(q[0]), q[1]), (jnp.int32(kv[0]), kv[1])
                assert bool(sharded.visits(*offsets, (LENGTH, LENGTH), params, xp=jnp)) == visits
                skipped += not visits
        assert skipped > 0, name  # the bounds do skip (each of these masks hides whole blocks)


def test_the_sharded_form_trains_what_reads_no_position():
    """[grad] params read at indices that read no position stay trained in the sharded form (each
    block's backward returns its share); one read at each pair's own position has no sharded form."""
    assert ShardedSpec.of(small("alibi_slopes")).form.grad_params == ("slopes",)
    text = Path(load_spec("specs/bias.toml").path).read_text() + '\n[grad]\nparams = ["bias"]\n'
    with pytest.raises(SpecError, match=r"trains bias, read at each \(query, key\) pair"):
        _ = ShardedSpec.of(parse_spec(text)).form  # (a property: refuses when read)


if __name__ == "__main__":  # the JAX test's subprocess: XLA_FLAGS set before jax starts
    _jax_devices(int(sys.argv[1]), sys.argv[2])
