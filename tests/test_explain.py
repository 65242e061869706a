"""attngen explain: tile classes against hand counts and the dense mask, costs, the PNG, the CLI."""

import struct
import zlib
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest

from attngen import ir, png
from attngen.analysis.tiles import TileBounds
from attngen.backends import TARGETS
from attngen.cli import main
from attngen.explain import EMPTY, FULL, PARTIAL, Problem, explain, kind_of, render, write_png
from attngen.spec import load_spec, retarget, with_config

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.toml"))


def _triton_tiles(spec, block_m: int, block_n: int):
    """The spec with every Triton kernel's tiles set to block_m queries x block_n keys."""
    config = spec.config("triton_gpu")
    keys = {f.name: block_m if f.name.endswith("block_m") else block_n for f in fields(config)}
    return with_config(spec, "triton_gpu", **{k: v for k, v in keys.items() if k.endswith(("block_m", "block_n"))})


def test_causal_tile_counts_match_the_hand_count():
    # 1024 x 1024, 128 x 64 tiles: q block i holds rows 128i..128i+127, so kv blocks j < 2i are
    # FULL, 2i and 2i+1 PARTIAL (the diagonal), the rest EMPTY: 8 q blocks x 16 kv blocks.
    spec = _triton_tiles(load_spec(ROOT / "specs/causal.toml"), 128, 64)
    ex = explain(spec, Problem(1024, 1024))
    full = sum(2 * i for i in range(8))
    for name in ("fwd", "bwd_dq", "bwd_dkdv"):
        m = ex.maps[name]
        assert m.runs.shape == (1, 1, 8, 16)
        assert (m.count(EMPTY), m.count(PARTIAL), m.count(FULL)) == (128 - full - 16, 16, full)
        assert np.array_equal(m.runs, m.exact)  # causal bounds are exact
        assert m.unsound == 0 and m.conservative(EMPTY) == m.conservative(FULL) == 0
        assert m.visible_pairs == 1024 * 1025 // 2


@pytest.mark.parametrize("window", [100, 256, 1000])
def test_sliding_window_skips_what_the_mask_hides_up_to_a_tile(window):
    spec = _triton_tiles(load_spec(ROOT / "specs/sliding_window.toml"), 64, 64)
    ex = explain(spec, Problem(4096, 4096), params={"window": str(window)})
    for m in ex.maps.values():
        if m.kind == "decode":
            continue
        visible = m.visible_pairs / m.pairs
        visited = 1 - m.skipped
        # Visited tiles cover every visible pair, and at most a tile more per row block at each
        # edge of the band.
        assert visible <= visited <= visible + (m.block_q + 2 * m.block_kv) / 4096
        assert m.unsound == 0


def test_full_mask_costs_are_the_flashattention_accounting():
    spec = _triton_tiles(load_spec(ROOT / "specs/full.toml"), 128, 64)
    n, d, item = 1024, spec.head_dim, 2  # bfloat16
    cost = explain(spec, Problem(n, n)).maps["fwd"].cost
    assert cost.flops_done == cost.flops_dense == cost.flops_useful == 4 * n * n * d
    # Q once; K and V once per q block (8 of them); O and the float32 LSE once.
    assert cost.bytes_read == n * d * item + (n // 128) * n * 2 * d * item
    assert cost.bytes_written == n * d * item + n * 4
    assert cost.intensity == pytest.approx(cost.flops_done / (cost.bytes_read + cost.bytes_written))


def _pixels(data: bytes) -> tuple[int, int, bytes]:
    """(width, height, RGB bytes) of an 8-bit RGB PNG without filtering, read chunk by chunk
    (each chunk's CRC checked)."""
    assert data[:8] == png.SIGNATURE
    pos, chunks = 8, {}
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2) and b"IEND" in chunks
    raw = zlib.decompress(chunks[b"IDAT"])
    rows = [raw[y * (1 + 3 * width) : (y + 1) * (1 + 3 * width)] for y in range(height)]
    assert all(row[0] == 0 for row in rows)  # filter type none
    return width, height, b"".join(row[1:] for row in rows)


def test_png_is_valid_and_draws_each_tile(tmp_path):
    # Pallas, causal 1024 x 1024 in 512 x 512 tiles: four panels (fwd, dQ, dK/dV of 2 x 2 tiles,
    # 512 pixels a side; decode, one row of 2 tiles stretched to 16 pixels), 16-pixel gaps.
    ex = explain(load_spec(ROOT / "specs/causal.toml"), Problem(1024, 1024), target="pallas_tpu")
    assert ex.launched == ("fwd", "bwd_dq", "bwd_dkdv", "decode")
    data = write_png(ex, tmp_path / "tiles.png").read_bytes()
    assert png.size(data) == (4 * 512 + 5 * 16, 512 + 2 * 16)
    width, height, rgb = _pixels(data)
    assert len(rgb) == width * height * 3
    pixel = lambda x, y: tuple(rgb[3 * (y * width + x) : 3 * (y * width + x) + 3])
    assert pixel(16 + 3 * 128, 16 + 128) == (255, 255, 255)  # fwd, q block 0 x kv block 1: EMPTY
    assert pixel(16 + 128, 16 + 3 * 128) == (31, 78, 121)  # q block 1 x kv block 0: FULL
    assert pixel(16 + 128, 16 + 128) == (242, 142, 43)  # the diagonal: PARTIAL
    assert pixel(0, 0) == (235, 235, 235)  # background


def test_png_encoder_rejects_a_wrong_size():
    with pytest.raises(ValueError):
        png.encode(2, 2, b"\x00" * 11)
    assert png.size(png.encode(3, 1, bytes(9))) == (3, 1)


@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_no_kernel_gets_a_tile_wrong(spec_file):
    """The compiler's invariant: no tile the kernels skip holds a visible pair, and no tile they run
    without mask code holds a hidden one -- for every spec, every kernel of both targets, at odd
    sizes with both length orders, several batches and heads, and small tiles (many of them)."""
    spec = _triton_tiles(load_spec(spec_file), 16, 32)
    spec = with_config(spec, "pallas_tpu", block_q=8, block_kv=16)
    for q_len, kv_len in ((77, 93), (93, 77)):
        problem = Problem(q_len, kv_len, batch=2, heads=2, new_tokens=3)
        for target in ("triton_gpu", "pallas_tpu"):
            ex = explain(spec, problem, target=target)
            for name, m in ex.maps.items():
                assert m.unsound == 0, f"{spec.name} {target} {name} at {q_len} x {kv_len}"


def test_an_unsound_bound_is_reported(monkeypatch):
    """Bounds that call every tile FULL (or skip every tile) are caught: the check can fail."""
    spec = _triton_tiles(load_spec(ROOT / "specs/causal.toml"), 16, 16)
    one = lambda value: ir.Const(ir.Type.INT, value)
    # 4 x 4 tiles: 6 FULL below the diagonal, 4 PARTIAL on it, 6 EMPTY above.
    for hi in (1000, 0):  # every tile FULL: 10 wrong (those not FULL); none visited: 10 (those not EMPTY)
        wrong = TileBounds(one(0), one(hi), one(0), one(hi), affine=True)
        monkeypatch.setattr(
            "attngen.explain.kernel_tile_bounds",
            lambda spec, backend, wrong=wrong: {k.name: wrong for k in backend.kernels},
        )
        ex = explain(spec, Problem(64, 64))
        assert ex.maps["fwd"].unsound == 10
        assert "BUG: fwd gets 10 tile(s) wrong" in render(ex)


def test_every_kernel_has_a_kind():
    for target in TARGETS:
        for kernel in target.kernels:
            assert kind_of(kernel) in ("forward", "dq", "dkdv", "fused", "decode")
    with pytest.raises(KeyError, match="KINDS"):
        kind_of(replace(TARGETS[0].kernels[0], name="bwd_dlse"))


def test_cli_prints_and_writes(tmp_path, capsys):
    spec = str(ROOT / "specs/sliding_window.toml")
    assert main(["explain", spec, "--q-len", "2048", "--params", "window=256", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "params: window=256 (given)" in out
    assert "kv_lo = max(0, q_first - window + 1) // BLOCK_N" in out
    assert "H200 SXM" in out and "A100 SXM 80GB" in out
    assert png.size((tmp_path / "sliding_window_triton_gpu_tiles.png").read_bytes())[0] > 0
    # Without --params, the example value; on a TPU target, the TPU chips.
    args = ["explain", spec, "--q-len", "1000", "--target", "pallas_tpu", "--gpu", "tpu-v5e", "--out", str(tmp_path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "window=70 (from attngen.testing.example_params)" in out and "TPU v5e" in out
    assert (tmp_path / "sliding_window_pallas_tpu_tiles.png").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--params", "window=wide"], "param window is int, got 'wide'"),
        (["--params", "size=3"], "has no param 'size'"),
        (["--params", "window"], "--params takes NAME=VALUE"),
        (["--gpu", "tpu-v6e"], "triton_gpu kernels run on h100, h200, a100"),
        (["--q-len", "0"], "must be positive"),
    ],
)
def test_cli_reports_bad_arguments(args, message, tmp_path, capsys):
    spec = str(ROOT / "specs/sliding_window.toml")
    assert main(["explain", spec, "--out", str(tmp_path), *args]) == 2
    assert message in capsys.readouterr().err


def test_explain_picks_the_forward_a_window_takes_on_hopper():
    """As the module does (sm90_forward_min_keys): a window of 1024 (1152 keys a program) runs the
    Triton forward on an H200, one of 4096 the Hopper forward; FP8's kernel never serves attention."""
    spec = load_spec(ROOT / "specs/sliding_window.toml")
    short = explain(spec, Problem(4096, 4096), params={"window": "1024"}, accelerator="h200")
    assert short.launched[0] == "fwd" and "1152 keys" in short.not_launched["fwd_sm90"]
    assert "attention_fp8" in short.not_launched["fwd_sm90_fp8"]
    long = explain(spec, Problem(4096, 4096), params={"window": "4096"}, accelerator="h200")
    assert long.launched[0] == "fwd_sm90"


def test_explain_says_which_backward_kernels_serve_which_calls():
    """On Hopper the fused backward, where a spec takes it, serves a call (it does the dQ and the dK/dV
    kernels' work: both costed as one), the Gluon dQ and dK/dV kernels a deterministic call, and the
    Triton dQ kernel a call whose [grad] params want gradients (the generated module's _backward); a
    call of at most sm90_fused_min_queries queries runs the dQ and dK/dV kernels."""
    fused = {
        name: with_config(load_spec(ROOT / f"specs/{name}.toml"), "triton_gpu", sm90_fused_backward=1)
        for name in ("alibi_slopes", "causal")
    }
    ex = explain(fused["alibi_slopes"], Problem(4096, 4096), accelerator="h200")
    assert "bwd_fused_sm90" in ex.launched and "bwd_dq_sm90" not in ex.launched
    assert ex.not_launched["bwd_dq"] == (
        "bwd_fused_sm90 serves this call, and every call whose [grad] params want gradients (it gathers them)"
    )
    deterministic = "bwd_fused_sm90 serves this call; a deterministic call (torch.use_deterministic_algorithms)"
    assert ex.not_launched["bwd_dq_sm90"] == f"{deterministic} runs this one"
    assert (
        ex.not_launched["bwd_dkdv_sm90"] == f"{deterministic} or one whose [grad] params want gradients runs this one"
    )
    plain = explain(fused["causal"], Problem(2049, 2049), accelerator="h200")
    assert plain.not_launched["bwd_dq"] == "bwd_fused_sm90 serves this call"
    short = explain(fused["causal"], Problem(2048, 4096), accelerator="h200")
    assert {"bwd_dq_sm90", "bwd_dkdv_sm90"} <= set(short.launched)
    assert short.not_launched["bwd_fused_sm90"] == "2048 queries, at most sm90_fused_min_queries = 2048"
    # Where it is off (heads of 256 cannot take it), the dQ and dK/dV kernels serve every call.
    wide = explain(
        retarget(load_spec(ROOT / "specs/causal.toml"), 256, "bfloat16"), Problem(1024, 1024), accelerator="h200"
    )
    assert {"bwd_dq_sm90", "bwd_dkdv_sm90"} <= set(wide.launched)
    assert wide.not_launched["bwd_fused_sm90"] == "off (sm90_fused_backward = 0)"
