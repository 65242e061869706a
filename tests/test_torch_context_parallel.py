"""attngen's kernels inside torch's own context parallelism (attngen.parallel.torch_recipe), on CPU.

Two gloo processes run torch's ring templates (torch.distributed.tensor.experimental) with the
generated Triton kernels in the interpreter as the attention op: causal attention sharded by
torch's `context_parallel` context (its head-tail load balancer; K/V rotated by all-gather) and
full attention sharded by `_context_parallel_shard` without a balancer (contiguous; K/V rotated by
all-to-all). Output, LSE and q/k/v gradients, unsharded by torch's `context_parallel_unshard`, are
judged against float64 attention of the whole sequence. GQA heads; small tiles (16) so that each
block spans several tiles.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from attngen.exactness import assert_forward, assert_grads
from attngen.parallel import pieces
from attngen.reference import attention_ref_torch
from attngen.spec import load_spec, parse_spec, retarget, with_config

WORLD, LENGTH, HEADS, KV_HEADS, DIM = 2, 96, 4, 2, 32
CASES = ("causal", "full")


def small(name):
    spec = retarget(load_spec(f"specs/{name}.toml"), DIM, "float32")
    return with_config(spec, "triton_gpu", block_m=16, block_n=16, dq_block_m=16, dq_block_n=16,
                       dkdv_block_m=16, dkdv_block_n=16, short_block_m=16, short_block_n=16)  # fmt: skip


def problem():
    """q, k, v and the output's cotangent, the same in every process."""
    g = torch.Generator().manual_seed(11)
    q, do = (torch.randn(1, HEADS, LENGTH, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(1, KV_HEADS, LENGTH, DIM, generator=g) for _ in range(2))
    return q, k, v, do


def _rank(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import (
        _context_parallel_shard,
        _HeadTailLoadBalancer,
        context_parallel_unshard,
        set_rotate_method,
    )

    from attngen.parallel.torch_recipe import TorchRing

    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    ring = TorchRing(causal=small("causal"), full=small("full"))

    def run(q, k, v, do, is_causal):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out, lse = ring.attention(*leaves, mesh=mesh, is_causal=is_causal, return_lse=True)
        (out * do).sum().backward()
        return [out.detach(), lse, *(x.grad for x in leaves)]

    # causal: torch's context_parallel shards q, k, v, do in place, head-tail (the length divides by 2 * world)
    q, k, v, do = problem()
    balancer = _HeadTailLoadBalancer(LENGTH, world, "cpu")
    with context_parallel(mesh, buffers=[q, k, v, do], buffer_seq_dims=[2, 2, 2, 2]):
        assert q.shape[2] == LENGTH // world
        local = run(q, k, v, do, is_causal=True)
    causal = context_parallel_unshard(mesh, local, [2] * 5, load_balancer=balancer)

    # full: no load balancer (torch refuses is_causal=False with one), contiguous shards, all-to-all rotation
    set_rotate_method("alltoall")
    shards = _context_parallel_shard(mesh, list(problem()), [2, 2, 2, 2], load_balancer=None)
    full = context_parallel_unshard(mesh, run(*shards, is_causal=False), [2] * 5, load_balancer=None)
    set_rotate_method("allgather")

    if rank == 0:
        for name, results in zip(CASES, (causal, full)):
            named = dict(zip(("out", "lse", "dq", "dk", "dv"), results))
            np.savez(Path(out_dir) / f"{name}.npz", **{n: t.numpy() for n, t in named.items()})
    dist.destroy_process_group()
    # After torch's functional collectives on gloo (the rotaters' all_gather_single and
    # permute_tensor), about one exit in ten aborts in interpreter teardown ("terminate called
    # without an active exception"), with no attngen code in the process; leave without it.
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def judge(name, got):
    """Each result (whole sequence, float32) against the float64 reference."""
    q, k, v, do = problem()
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = attention_ref_torch(small(name), qr, kr, vr)
    (ref_out * do.double()).sum().backward()
    assert_forward("float32", got["out"], got["lse"], ref_out.detach().numpy(), ref_lse.detach().numpy())
    assert_grads("float32", {n: got[n] for n in ("dq", "dk", "dv")}, {"dq": qr.grad, "dk": kr.grad, "dv": vr.grad})


def test_torch_ring_templates_run_the_kernels_exactly(tmp_path, monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "cache"))
    mp.spawn(_rank, args=(WORLD, _free_port(), str(tmp_path)), nprocs=WORLD)
    for name in CASES:
        judge(name, dict(np.load(tmp_path / f"{name}.npz")))


def test_head_tail_order_is_the_zigzag_layout():
    """torch's _HeadTailLoadBalancer cuts the sequence as attngen.parallel's "zigzag" layout: shards
    torch made feed ContextParallel(layout="zigzag") for the masks torch's ring cannot run."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    for world in (1, 2, 3, 4):
        length = 2 * world * 5
        order = _HeadTailLoadBalancer(length, world, "cpu")._generate_indices()[0].tolist()
        held = [piece for r in range(world) for piece in pieces(length, world, r, "zigzag")]
        zigzag = [i for start, size in held for i in range(start, start + size)]
        assert order == zigzag


def _spec(body):
    return parse_spec(f'name = "probe"\nhead_dim = {DIM}\ndtype = "float32"\n{body}')


@pytest.mark.parametrize(
    ("causal", "full", "match"),
    [
        (lambda: small("full"), None, "is not top-left causal"),
        (None, lambda: small("causal"), "is not unmasked"),
        (lambda: _spec('[mask]\nexpr = "q_idx >= kv_idx and q_idx - kv_idx < 8"'), None, "is not top-left causal"),
        (lambda: _spec('[mask]\ncausal = true\n[score]\nexpr = "score - q_idx + kv_idx"'), None, "reads positions"),
        (lambda: small("alibi"), None, "takes params"),
        (lambda: small("sinks"), None, "takes params"),
    ],
)
def test_torch_ring_refuses_what_it_cannot_run(causal, full, match):
    """torch's ring tells the op only is_causal per block: specs that need more are refused before a build."""
    from attngen.parallel.torch_recipe import TorchRing

    with pytest.raises(ValueError, match=match):
        TorchRing(causal=causal and causal(), full=full and full())
