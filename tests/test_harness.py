"""The test harness itself: load_target runs the kernels a spec asks for.

Tests replace tile sizes on a spec (tests/test_variants.py's small_tiles), which keeps
spec.sha256: a cache keyed by the hash alone would hand back the module built earlier with other
tiles. Nothing here runs a kernel.
"""

from attngen.spec import load_spec
from tests import harness
from tests.test_variants import SMALL_TRITON_TILES, small_tiles


def test_replaced_triton_tiles_load_their_own_module():
    spec = harness.with_dtype(load_spec("specs/causal.toml"), "float32")
    small = small_tiles(spec, "triton")
    assert small.sha256 == spec.sha256
    tiles = (SMALL_TRITON_TILES["block_m"], SMALL_TRITON_TILES["block_n"])
    first = harness.load_target(spec, "triton_gpu")
    assert (first.BLOCK_M, first.BLOCK_N) != tiles  # the spec's own tiles, built first
    second = harness.load_target(small, "triton_gpu")
    assert (second.BLOCK_M, second.BLOCK_N) == tiles
    assert (second.DQ_BLOCK_M, second.DQ_BLOCK_N) == (
        SMALL_TRITON_TILES["dq_block_m"],
        SMALL_TRITON_TILES["dq_block_n"],
    )
    assert harness.load_target(spec, "triton_gpu") is first  # still cached


def test_replaced_pallas_blocks_load_their_own_module():
    spec = harness.with_dtype(load_spec("specs/causal.toml"), "float32")
    small = small_tiles(spec, "pallas")
    assert small.sha256 == spec.sha256
    first = harness.load_target(spec, "pallas_tpu")
    assert (first.BLOCK_Q, first.BLOCK_KV) != (64, 128)  # small_tiles' blocks
    second = harness.load_target(small, "pallas_tpu")
    assert (second.BLOCK_Q, second.BLOCK_KV) == (64, 128)
