"""`attngen tune` and the tuned table, on a CPU: the search space, the table's round trip and
lookup, and clear errors. (The search itself runs kernels: it needs a GPU; see BENCHMARKS.md.)"""

import dataclasses
from pathlib import Path

import pytest

from attngen.backends import triton_gpu
from attngen.backends.base import ProblemShape
from attngen.backends.triton_gpu import KERNELS, TRITON_GPU, TritonConfig, TunedEntry, default_config, write_tuned_table
from attngen.cli import main
from attngen.spec import load_spec, retarget
from attngen.tune import Candidate, search_space

SPECS = Path(__file__).resolve().parent.parent / "specs"


def test_candidates_name_each_kernels_fields():
    c = Candidate(rows=128, step=32, warps=8, stages=3)
    kernel = TRITON_GPU.kernel
    assert c.config(kernel("fwd")) == {"block_m": 128, "block_n": 32, "num_warps": 8, "num_stages": 3}
    assert c.config(kernel("bwd_dq")) == {"dq_block_m": 128, "dq_block_n": 32, "dq_num_warps": 8, "dq_num_stages": 3}
    # dK/dV holds keys (its block_n) and steps over queries (its block_m)
    dkdv = {"dkdv_block_m": 32, "dkdv_block_n": 128, "dkdv_num_warps": 8, "dkdv_num_stages": 3}
    assert c.config(kernel("bwd_dkdv")) == dkdv
    short = {"short_block_m": 128, "short_block_n": 32, "short_num_warps": 8, "short_num_stages": 3}
    assert c.config(kernel("fwd_short")) == short
    fields = {f.name for f in dataclasses.fields(TritonConfig)}
    # lengths, the Hopper kernels' switches and the decode split rule's occupancy are not searched
    unsearched = {"short_kv_len", "sm90_forward_min_keys", "sm90_forward", "sm90_backward", "sm90_dq", "sm90_fp8"}
    unsearched |= {"sm90_fused_backward", "sm90_fused_min_queries"}
    unsearched |= {"decode_programs_per_sm"}
    assert set().union(*(c.config(k) for k in KERNELS)) == fields - unsearched


def test_search_spaces():
    fwd = TRITON_GPU.kernel("fwd")
    assert len(search_space(fwd, quick=False)) == 36 and len(set(search_space(fwd, quick=False))) == 36
    quick = search_space(fwd, quick=True)
    assert len(quick) == 6 and all(c.stages == 3 for c in quick)


@pytest.mark.parametrize("name", ["fwd_sm90", "bwd_dq_sm90", "bwd_dkdv_sm90", "bwd_fused_sm90"])
def test_the_hopper_kernels_search_what_the_backend_leaves_free(name):
    """Every candidate of a Gluon kernel passes the backend's checks (128 rows, or 64 in the dQ and
    dK/dV kernels; one warpgroup per consumer); --quick searches the same 4 (the forward, the fused
    backward) or 8."""
    kernel = TRITON_GPU.kernel(name)
    space = search_space(kernel, quick=False)
    assert space == search_space(kernel, quick=True)
    assert len(set(space)) == (8 if name in ("bwd_dq_sm90", "bwd_dkdv_sm90") else 4)

    def refuse(message, key=None, hint=None):
        raise AssertionError(message)

    for candidate in space:
        TRITON_GPU.make_config(candidate.config(kernel), ProblemShape(128, 128, "bfloat16"), refuse)


def test_the_tables_candidate_is_always_timed(monkeypatch):
    """--quick's 6 forward candidates lack the D = 64 entry's forward (128 x 64 over 4 warps): it is
    timed first anyway, so a recorded winner has beaten what the table held."""
    torch = pytest.importorskip("torch")
    from attngen import tune as tune_module

    for name, value in (("is_available", True), ("get_device_name", "NVIDIA H200"), ("get_device_capability", (8, 0))):
        monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)
    spaces = {}

    def search(self, workloads, config, kernel, space):
        spaces[kernel.name] = space
        return space[-1]

    monkeypatch.setattr(tune_module._Tuner, "search", search)
    workload = tune_module.Workload(load_spec(SPECS / "causal.toml"), {})
    list(tune_module.tune([workload], [64], ["bfloat16"], [4096], quick=True, log=lambda line: None))
    table = TritonConfig(**default_config(64, "bfloat16"))
    assert Candidate(128, 64, 4, 3) not in search_space(TRITON_GPU.kernel("fwd"), quick=True)
    assert spaces["fwd"][0] == Candidate.of(TRITON_GPU.kernel("fwd"), table) == Candidate(128, 64, 4, 3)
    assert len(spaces["fwd"]) == 7
    dkdv = TRITON_GPU.kernel("bwd_dkdv")  # holds keys (block_n), steps over queries (block_m)
    held = Candidate.of(dkdv, table).config(dkdv)
    assert held == {key: getattr(table, key) for key in held}


def test_the_fused_backward_is_on_in_its_own_search_only(monkeypatch):
    """On Hopper the dQ and dK/dV kernels are timed with the fused backward off (it would serve the
    backward in their place), and the fused backward with it on."""
    torch = pytest.importorskip("torch")
    from attngen import tune as tune_module

    for name, value in (("is_available", True), ("get_device_name", "NVIDIA H200"), ("get_device_capability", (9, 0))):
        monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)
    fused = {}

    def search(self, workloads, config, kernel, space):
        fused[kernel.name] = config.sm90_fused_backward
        return space[0]

    monkeypatch.setattr(tune_module._Tuner, "search", search)
    table = tune_module.default_config  # (as if the table's entry took the fused backward)
    monkeypatch.setattr(tune_module, "default_config", lambda *entry: {**table(*entry), "sm90_fused_backward": 1})
    workload = tune_module.Workload(load_spec(SPECS / "causal.toml"), {})
    list(tune_module.tune([workload], [128], ["bfloat16"], [4096], quick=True, log=lambda line: None))
    assert fused["bwd_fused_sm90"] == 1
    assert fused["bwd_dq_sm90"] == fused["bwd_dkdv_sm90"] == fused["bwd_dkdv"] == 0


def test_every_spec_dtype_and_head_dim_has_a_default():
    for dtype in ("bfloat16", "float16", "float32"):
        for head_dim in (16, 40, 64, 80, 96, 128, 160, 256):
            TritonConfig(**default_config(head_dim, dtype))  # every field present, no extra


def test_lookup_takes_the_smallest_entry_that_fits():
    assert default_config(80, "bfloat16") == default_config(128, "bfloat16")
    assert default_config(64, "bfloat16") != default_config(65, "bfloat16")


def test_table_round_trip_and_merge(tmp_path, monkeypatch):
    table = tmp_path / "tuned.toml"
    table.write_text(triton_gpu.TUNED_TABLE.read_text())
    monkeypatch.setattr(triton_gpu, "TUNED_TABLE", table)
    before = default_config(64, "float16")
    tuned = {**before, "block_m": 64, "num_stages": 4}
    write_tuned_table([TunedEntry("NVIDIA H200", 64, "float16", tuned)], path=table)
    assert default_config(64, "float16") == tuned
    assert default_config(64, "bfloat16") != tuned  # other entries untouched
    write_tuned_table([TunedEntry("Other GPU", 64, "float16", before)], path=table)
    assert default_config(64, "float16") == tuned  # builds target the table's default GPU
    assert table.read_text().count("[[entry]]") == len(triton_gpu._load_table(table)[1])


def test_retarget_keeps_pinned_keys_and_redefaults_the_rest(tmp_path):
    spec_file = tmp_path / "s.toml"
    spec_file.write_text('name = "s"\nhead_dim = 128\n[triton]\nnum_stages = 2\n')
    spec = load_spec(spec_file)
    assert spec.tables["triton_gpu"] == {"num_stages": 2}
    small = retarget(spec, 64, "float16").config("triton_gpu")
    assert small.num_stages == 2
    assert small.block_n == default_config(64, "float16")["block_n"]


def test_tune_records_the_fields_it_searched_only(monkeypatch):
    """A tuned entry holds the table's fields and the searched kernels' winners: a field it did not
    search (a switch, a length, what the backend derives per head dim) keeps the backend's default
    (recording the whole config pinned FP8's two-stage ring and the Hopper forward at short calls
    over make_config's choices for heads of 64)."""
    torch = pytest.importorskip("torch")
    from attngen import tune as tune_module

    for name, value in (("is_available", True), ("get_device_name", "NVIDIA H200"), ("get_device_capability", (9, 0))):
        monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)
    winner = Candidate(rows=128, step=128, warps=4, stages=3)
    monkeypatch.setattr(tune_module._Tuner, "search", lambda self, workloads, config, kernel, space: winner)
    workload = tune_module.Workload(load_spec(SPECS / "causal.toml"), {})
    (entry,) = tune_module.tune([workload], [64], ["bfloat16"], [4096], quick=True, log=lambda line: None)
    table = TritonConfig(**default_config(64, "bfloat16"))  # (a kernel it turns off is not searched)
    searched = set().union(
        *(winner.config(k) for k in tune_module.TUNED_KERNELS if not k.enabled_by or getattr(table, k.enabled_by))
    )
    assert set(entry.config) == set(default_config(64, "bfloat16")) | searched
    assert entry.config["sm90_dq_block_n"] == 128 and "sm90_fp8_num_stages" not in entry.config
    assert "sm90_forward_min_keys" not in entry.config
    # --kernel: that kernel's fields change, the rest are the table's
    (entry,) = tune_module.tune([workload], [128], ["bfloat16"], [4096], log=lambda line: None, kernels=("fwd",))
    assert entry.config == {**default_config(128, "bfloat16"), **winner.config(TRITON_GPU.kernel("fwd"))}


def test_a_candidate_that_faults_the_gpu_ends_the_tune_clearly_and_loses_no_entry(tmp_path, monkeypatch, capsys):
    """A candidate's illegal address leaves the CUDA context unusable: the tune stops at it with
    what it found and how to go on, and the entries found before it are in the table already."""
    torch = pytest.importorskip("torch")
    from attngen import tune as tune_module

    table = tmp_path / "tuned.toml"
    table.write_text(triton_gpu.TUNED_TABLE.read_text())
    monkeypatch.setattr(triton_gpu, "TUNED_TABLE", table)
    for name, value in (("is_available", True), ("get_device_name", "NVIDIA H200"), ("get_device_capability", (9, 0))):
        monkeypatch.setattr(torch.cuda, name, lambda *args, value=value: value)
    faulted = []

    def prepare(self, w, kernel):
        if w.spec.head_dim == 128 and kernel.name == "bwd_dq":
            faulted.append(True)
            raise tune_module.Rejected("Triton Error [CUDA]: an illegal memory access was encountered")

    def time(self, runs, kernel):
        return [1.0 if w.spec.config("triton_gpu").num_stages == 2 else 2.0 for module, w in runs]

    def synchronize(*args):
        if faulted:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(tune_module._Tuner, "_prepare", prepare)
    monkeypatch.setattr(tune_module._Tuner, "_time", time)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    before = default_config(128, "bfloat16")
    args = ["tune", str(SPECS / "causal.toml"), "--head-dim", "64", "--head-dim", "128", "--kernel", "fwd"]
    assert main([*args, "--kernel", "bwd_dq"]) == 2
    err = capsys.readouterr().err
    # (the table's candidate comes first: dQ's at head_dim 128)
    assert "bwd_dq dq_block_m=128 dq_block_n=64 dq_num_warps=8 dq_num_stages=3 faulted (CUDA error: an illegal" in err
    found = "{'block_m': 64, 'block_n': 32, 'num_warps': 4, 'num_stages': 2}"
    assert f"Found so far at head_dim=128, bfloat16: {found}" in err
    assert "tune bwd_dq and the kernels after it again with --kernel" in err
    # head_dim 64's entry was recorded before the fault (its winner: the first 2-stage forward); 128's is as it was
    assert default_config(64, "bfloat16")["block_n"] == 32 and default_config(128, "bfloat16") == before


def _timed_search(monkeypatch, times, space_size=3):
    """_Tuner.search over candidates whose rounds take `times[candidate index][round]` ms (one
    workload, one length): (the winner's index, the order the candidates were timed in)."""
    from attngen import tune as tune_module

    kernel = next(k for k in KERNELS if k.name == "fwd")
    config = TritonConfig(**default_config(128, "bfloat16"))
    table = tune_module.Candidate.of(kernel, config)
    space = [table, *(c for c in search_space(kernel, quick=False) if c != table)][:space_size]
    order = []

    def time(self, runs, kernel):
        ((module, _),) = runs
        order.append(module)
        return [times[module][sum(1 for m in order if m == module) - 1]]

    prepared = iter(range(len(space)))
    monkeypatch.setattr(tune_module._Tuner, "_prepare", lambda self, w, kernel: next(prepared))
    monkeypatch.setattr(tune_module._Tuner, "_time", time)
    tuner = tune_module._Tuner(Path("."), [4096], lambda line: None)
    workload = tune_module.Workload(load_spec(SPECS / "causal.toml"), {})
    best = tuner.search([workload], config, kernel, space)
    return space.index(best), order


def test_candidates_are_timed_in_rounds_of_alternating_order_and_scored_by_their_medians(monkeypatch):
    """A kernel timed right after a heavier one reads slow (BENCHMARKS.md, 2026-12-04): every
    candidate is timed once a round, the order reversed every other round, and one slow round
    does not decide."""
    from attngen import tune as tune_module

    # Candidate 1's second round is an outlier; its median (1.0) still beats the table's (1.5).
    best, order = _timed_search(monkeypatch, [[1.5] * 4, [1.0, 9.0, 1.0, 1.0], [1.2] * 4])
    assert tune_module.ROUNDS == 4 and order == [0, 1, 2, 2, 1, 0, 0, 1, 2, 2, 1, 0]
    assert best == 1


def test_a_winner_within_the_noise_keeps_the_tables_configuration(monkeypatch):
    """Timing the same kernel twice differs by up to 2-3 %: a candidate must beat the table's
    configuration (candidate 0) by more than MIN_GAIN to replace it."""
    assert _timed_search(monkeypatch, [[1.0] * 4, [0.99] * 4, [1.1] * 4])[0] == 0
    assert _timed_search(monkeypatch, [[1.0] * 4, [0.95] * 4, [1.1] * 4])[0] == 1


def test_tune_needs_a_gpu_and_every_param(capsys):
    assert main(["tune", str(SPECS / "sliding_window.toml")]) == 2
    assert "--param window=VALUE" in capsys.readouterr().err
    assert main(["tune", str(SPECS / "sliding_window.toml"), "--param", "window=wide"]) == 2
    assert "window is declared int" in capsys.readouterr().err
    assert main(["tune", str(SPECS / "alibi_slopes.toml")]) == 2
    assert "param slopes is a tensor (float[heads]); attngen tune takes scalar params only" in capsys.readouterr().err
    pytest.importorskip("torch")
    import torch

    assert main(["tune", str(SPECS / "causal.toml"), "--kernel", "bwd_dq_sm9"]) == 2
    assert "no tuned kernel named bwd_dq_sm9; they are: fwd, " in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["tune", str(SPECS / "causal.toml"), "--quick"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
