"""`attngen tune`: search the Triton kernels' tile sizes, warps and stages on the GPU at hand.

Input: one or more specs (their masks and score expressions are the workload), the head dims,
dtypes and sequence lengths to tune for. Output: the fastest exact configuration of each kernel
(forward, dQ, dK/dV) per (GPU, head_dim, dtype), written to the tuned table that `attngen build`
reads for specs that do not pin their [triton] keys (attngen/backends/triton_tuned.toml).

Goals: every candidate is checked against the float64 reference on fresh inputs before it is
timed; a candidate that does not compile (too much shared memory) or is not exact is reported and
skipped, and one whose kernel faults (an illegal address, which no later launch of the process
survives) ends the run, saying what was found and how to go on; each (head_dim, dtype) entry is
recorded as soon as it is found. A candidate's score is the geometric mean of its times over every
spec and sequence length, so that no single shape decides (tuning on one length picks tiles that
lose on others); each time is the median of the rounds of attngen.timing, which time every exact
candidate in turn, in the opposite order every other round. The table's own configuration
is always among the candidates, and a winner replaces it only by more than MIN_GAIN, the spread of
timing the same kernel. --kernel limits the search to the kernels named.
The three kernels are tuned one after the other (forward alone; dQ with the table's dK/dV; dK/dV
with the best dQ), which keeps the search linear in the size of each space; on Hopper the fused
backward last, alone.
On a Hopper GPU the Gluon kernels are searched too (their tile height is fixed by wgmma: the
block they step over and the depth of their ring), each with the other Hopper kernel on; the
Triton forward and dK/dV kernels they replace there are tuned with the Hopper kernels off (the
module runs them when those are switched off). Elsewhere the Gluon kernels are skipped.
Non-goals: no search over the Pallas kernels (TPU tuning needs a TPU), no autotuning at run time.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from attngen.analysis.tiles import BY_KEY_BLOCK
from attngen.backends.base import Kernel
from attngen.backends.triton_gpu import (
    KERNELS,
    TUNED_TABLE,
    TritonConfig,
    TunedEntry,
    default_config,
    write_tuned_table,
)
from attngen.build import import_generated, write_package
from attngen.errors import AttngenError
from attngen.exactness import GRADIENTS, judge
from attngen.spec import Spec, retarget, with_config
from attngen.timing import ROUNDS, in_rounds

# The training family: the forward kernels are timed alone, the others with the whole backward.
TUNED_KERNELS = tuple(k for k in KERNELS if k.family == "training")
FORWARD_KERNELS = ("fwd", "fwd_short", "fwd_sm90")
HOPPER_SWITCHES = tuple(sorted({k.enabled_by for k in KERNELS if k.capabilities}))  # sm90_forward, _backward, _dq, ...
TOKENS = 16384  # batch * seq of every timed shape, as in the benchmark grid
MIN_GAIN = 0.02  # a winner's speed over the table's configuration that is more than noise


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One point of a kernel's search space: the block a program holds (rows), the block it
    steps over, warps and pipeline stages."""

    rows: int
    step: int
    warps: int
    stages: int

    def config(self, kernel: Kernel) -> dict[str, int]:
        """As TritonConfig fields of `kernel` (dK/dV holds keys, its block_n, and steps over queries)."""
        m, n = (self.step, self.rows) if kernel.walks is BY_KEY_BLOCK else (self.rows, self.step)
        prefix = kernel.tiles  # "", short_, dq_, dkdv_
        return {f"{prefix}block_m": m, f"{prefix}block_n": n, f"{prefix}num_warps": self.warps,
                f"{prefix}num_stages": self.stages}  # fmt: skip

    @staticmethod
    def of(kernel: Kernel, config: TritonConfig) -> Candidate:
        """The candidate `config` holds for `kernel` (Candidate.config's inverse)."""
        keys = ("block_m", "block_n", "num_warps", "num_stages")
        m, n, warps, stages = (getattr(config, f"{kernel.tiles}{key}") for key in keys)
        return Candidate(n, m, warps, stages) if kernel.walks is BY_KEY_BLOCK else Candidate(m, n, warps, stages)


_SPACE = [Candidate(*c) for c in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
# The Gluon kernels: two consumer warpgroups of one warpgroup each over 128 rows, 64 each (validated
# by the backend), or in the backward also over 64 rows, all for both (each half of the gradient's
# columns); the block they step over and their ring's depth are free. (The forward's three consumers
# over 192 rows serve plain attention only, which the table, by head_dim and dtype, cannot say:
# make_config chooses them.)
_HOPPER_SPACE = [Candidate(rows, step, 4, stages) for rows in (64, 128) for step in (64, 128) for stages in (2, 3)]


def search_space(kernel: Kernel, quick: bool) -> list[Candidate]:
    """The Triton kernels: 36 candidates; --quick keeps 3 stages, and 8 warps exactly for tiles of
    128 x 64 or more (the usual winners on Hopper): 6. The Gluon kernels: 4 (the forwards), 8 (dQ
    and dK/dV)."""
    if kernel.language == "gluon":
        return [c for c in _HOPPER_SPACE if c.rows == 128 or kernel.name in ("bwd_dq_sm90", "bwd_dkdv_sm90")]
    if quick:
        return [c for c in _SPACE if c.stages == 3 and (c.warps == 8) == (c.rows * c.step >= 128 * 64)]
    return list(_SPACE)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A spec at the head_dim and dtype being tuned, with its param values."""

    spec: Spec
    params: dict


def tune(
    workloads: list[Workload],
    head_dims: list[int],
    dtypes: list[str],
    seqs: list[int],
    quick: bool = False,
    log: Callable[[str], None] = print,
    kernels: tuple[str, ...] = (),
) -> Iterator[TunedEntry]:
    """The fastest exact configuration per (head_dim, dtype) on this GPU, each as soon as it is
    found; see the module doc. `kernels` (names) limits the search to those; the others keep the
    table's configuration."""
    unknown = set(kernels) - {k.name for k in TUNED_KERNELS}
    if unknown:
        raise AttngenError(
            f"no tuned kernel named {', '.join(sorted(unknown))}; they are: {', '.join(k.name for k in TUNED_KERNELS)}"
        )
    import torch

    if not torch.cuda.is_available():
        raise AttngenError("attngen tune runs the kernels: it needs a CUDA GPU (try `attngen check` on a CPU)")
    gpu = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    capability = 10 * major + minor
    with tempfile.TemporaryDirectory(prefix="attngen-tune-") as scratch:
        tuner = _Tuner(Path(scratch), seqs, log)
        for head_dim, dtype in itertools.product(head_dims, dtypes):
            targets = [Workload(retarget(w.spec, head_dim, dtype), w.params) for w in workloads]
            names = ", ".join(w.spec.name for w in targets)
            log(f"{dtype} head_dim={head_dim} on {gpu}: {names} at seq {', '.join(map(str, seqs))}")
            table = default_config(head_dim, dtype)
            config = TritonConfig(**table)
            tuned = {}
            for kernel in (k for k in TUNED_KERNELS if not kernels or k.name in kernels):
                if kernel.capabilities and capability not in kernel.capabilities:
                    log(
                        f"  {kernel.name}: built for compute capability {'/'.join(map(str, kernel.capabilities))}; kept"
                    )
                    continue
                if kernel.enabled_by in HOPPER_SWITCHES and not getattr(config, kernel.enabled_by):
                    log(f"  {kernel.name}: off at this head_dim and dtype ({kernel.enabled_by} = 0); kept")
                    continue
                if not tuner.lengths(kernel, config):
                    log(f"  {kernel.name}: no length to tune at (short_kv_len = {config.short_kv_len}); kept")
                    continue
                # A Gluon kernel is timed with the Hopper kernels as the module runs them; a Triton
                # kernel with them off, else a Hopper kernel would run in its place. The fused
                # backward is on for its own search only: in the others it would serve the backward
                # in place of the dQ and dK/dV kernels.
                hopper = {
                    switch: getattr(config, switch) if kernel.language == "gluon" else 0 for switch in HOPPER_SWITCHES
                }
                hopper["sm90_fused_backward"] &= kernel.enabled_by == "sm90_fused_backward"
                # The table's candidate is always timed, so that a winner has beaten it (--quick's
                # space may not hold it).
                space = list(dict.fromkeys([Candidate.of(kernel, config), *search_space(kernel, quick)]))
                try:
                    best = tuner.search(targets, dataclasses.replace(config, **hopper), kernel, space)
                except _GpuFault as e:
                    raise AttngenError(
                        f"{e}: no kernel can run in this process any more. Found so far at head_dim={head_dim}, "
                        f"{dtype}: {tuned or 'nothing'}; tune {kernel.name} and the kernels after it again with "
                        "--kernel"
                    ) from e
                config = dataclasses.replace(config, **best.config(kernel))
                tuned.update(best.config(kernel))
            # The searched fields over the table's: the rest (switches, lengths, what the backend
            # derives per head dim, as FP8's ring depth) keep the backend's defaults.
            log(f"  winner: {tuned}")
            yield TunedEntry(gpu, head_dim, dtype, {**table, **tuned})


class Rejected(Exception):
    """A candidate that cannot run here or is not exact."""


class _GpuFault(Exception):
    """A candidate whose kernel faulted (an illegal address): the CUDA context is lost for the process."""


class _Tuner:
    def __init__(self, scratch: Path, seqs: list[int], log: Callable[[str], None]):
        self.scratch, self.seqs, self.log = scratch, seqs, log
        self.count = 0

    def search(self, workloads: list[Workload], config: TritonConfig, kernel: Kernel, space) -> Candidate:
        """The candidate with the lowest geometric-mean time of `kernel`'s pass over the workloads,
        each time the median of ROUNDS rounds; the table's candidate (`config`'s) unless beaten by
        more than MIN_GAIN."""
        labels = {c: " ".join(f"{k}={v}" for k, v in c.config(kernel).items()) for c in space}
        ready = {}  # the exact candidates' modules, one per workload
        for i, candidate in enumerate(space, start=1):
            fields = {**dataclasses.asdict(config), **candidate.config(kernel)}
            at = [Workload(with_config(w.spec, "triton_gpu", **fields), w.params) for w in workloads]
            try:
                ready[candidate] = [(self._prepare(w, kernel), w) for w in at]
                self.log(f"  [{kernel.name} {i}/{len(space)}] {labels[candidate]}: exact")
            except Rejected as e:
                self.log(f"  [{kernel.name} {i}/{len(space)}] {labels[candidate]}: skipped ({e})")
                _check_gpu_usable(f"{kernel.name} {labels[candidate]}")

        def failed(candidate: Candidate, error: Exception) -> None:
            if not isinstance(error, Rejected):
                raise error
            self.log(f"  [{kernel.name}] {labels[candidate]}: skipped ({error})")
            _check_gpu_usable(f"{kernel.name} {labels[candidate]}")

        def started(r: int) -> None:
            self.log(f"  [{kernel.name}] timing round {r + 1}/{ROUNDS} of {len(ready)} exact candidates")

        timers = {candidate: functools.partial(self._time, runs, kernel) for candidate, runs in ready.items()}
        rounds = in_rounds(timers, ROUNDS, failed, started)  # each round: the times over workloads and lengths
        scores = {}
        for candidate, times in rounds.items():
            medians = [statistics.median(shape) for shape in zip(*times)]
            scores[candidate] = math.exp(sum(map(math.log, medians)) / len(medians))
            shown = " ".join(f"{ms:.3f}" for ms in medians)
            self.log(f"  [{kernel.name}] {labels[candidate]}: {scores[candidate]:.3f} ms (geomean of medians {shown})")
        if not scores:
            raise AttngenError(f"no {kernel.name} candidate compiled and was exact")
        best = min(scores, key=scores.get)
        table = Candidate.of(kernel, config)
        if table in scores and best != table and scores[table] < scores[best] * (1 + MIN_GAIN):
            self.log(f"  [{kernel.name}] {labels[best]} is within {MIN_GAIN:.0%} of the table's {labels[table]}: kept")
            return table
        return best

    def lengths(self, kernel: Kernel, config: TritonConfig) -> list[int]:
        """The sequence lengths `kernel`'s configuration runs at: the short forward serves those up
        to short_kv_len, the forward the longer ones, the backward kernels all."""
        if kernel.name == "fwd_short":
            return [n for n in self.seqs if n <= config.short_kv_len]
        if kernel.name == "fwd":
            return [n for n in self.seqs if n > config.short_kv_len]
        return self.seqs

    def _prepare(self, w: Workload, kernel: Kernel):
        """The candidate's module for workload w, checked against the float64 reference at a length
        its kernel serves (the short forward or the long one); Rejected if it fails or is not exact."""
        import triton

        module = self._load(w.spec)
        config = w.spec.config("triton_gpu")
        seq = {"fwd": config.short_kv_len + 512, "fwd_short": min(512, config.short_kv_len)}.get(kernel.name, 512)
        try:
            check_exact(module, w, seq)
        except (RuntimeError, triton.runtime.errors.OutOfResources) as e:
            raise Rejected(str(e).strip().splitlines()[0][:120]) from e
        return module

    def _time(self, runs: list[tuple[object, Workload]], kernel: Kernel) -> list[float]:
        """Median ms of the forward (kernels "fwd", "fwd_short") or of the whole backward, per workload
        (a module and its workload) and length."""
        import triton

        try:
            return [
                _time_pass(module, w, kernel.name, seq)
                for module, w in runs
                for seq in self.lengths(kernel, w.spec.config("triton_gpu"))
            ]
        except (RuntimeError, triton.runtime.errors.OutOfResources) as e:
            raise Rejected(str(e).strip().splitlines()[0][:120]) from e

    def _load(self, spec: Spec):
        self.count += 1
        out = self.scratch / str(self.count)
        write_package(spec, out)
        return import_generated(out / spec.name / "triton_gpu.py", f"_attngen_tune_{spec.name}_{self.count}")


def _check_gpu_usable(candidate: str) -> None:
    """Raise _GpuFault if the rejected candidate's kernel left the CUDA context unusable (an illegal
    address is sticky: every later launch of the process fails), rather than fail each candidate after it."""
    import torch

    try:
        torch.cuda.synchronize()
    except RuntimeError as e:  # torch.AcceleratorError
        raise _GpuFault(f"{candidate} faulted ({str(e).strip().splitlines()[0][:120]})") from e


def _time_pass(module, w: Workload, kernel: str, seq: int) -> float:
    import torch
    import triton

    batch, heads = max(1, TOKENS // seq), max(1, 2048 // w.spec.head_dim)
    dtype = getattr(torch, w.spec.dtype)
    q, k, v = (
        torch.randn(batch, heads, seq, d, device="cuda", dtype=dtype, requires_grad=kernel not in FORWARD_KERNELS)
        for d in (w.spec.head_dim, w.spec.head_dim, w.spec.value_dim)
    )
    if kernel in FORWARD_KERNELS:
        return triton.testing.do_bench(lambda: module.attention(q, k, v, **w.params))
    out = module.attention(q, k, v, **w.params)
    dout = torch.randn_like(out)
    # Both backward kernels run; only `kernel`'s configuration varies between candidates.
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))


def check_exact(module, w: Workload, seq: int = 512, heads: int = 2, kv_heads: int = 2) -> None:
    """Raise Rejected unless out, dq, dk and dv match the float64 reference by attngen.exactness's
    rule (the FlashAttention rule), the same computation in the kernel's dtype as the baseline."""
    import torch

    from attngen.reference import attention_ref_torch

    dtype = getattr(torch, w.spec.dtype)
    gen = torch.Generator(device="cuda")
    seed = gen.seed()  # fresh inputs for every candidate
    dims = (w.spec.head_dim, w.spec.head_dim, w.spec.value_dim, w.spec.value_dim)  # q, k, v, dout
    q, k, v, dout = (
        torch.randn(1, h, seq, d, device="cuda", generator=gen).to(dtype)
        for h, d in zip((heads, kv_heads, kv_heads, heads), dims)
    )
    try:
        ours = _out_and_grads(lambda *x: module.attention(*x, **w.params), q, k, v, dout)
    except Exception as e:  # a compiler failure (e.g. too much shared memory) rejects the candidate
        raise Rejected(str(e).strip().splitlines()[-1][:120] if str(e).strip() else type(e).__name__) from e
    exact, same_precision = (
        _out_and_grads(lambda *x, d=d: attention_ref_torch(w.spec, *x, dtype=d, **w.params)[0], q, k, v, dout)
        for d in (torch.float64, dtype)
    )
    errors, baseline, magnitudes = {}, {}, {}
    for name, x, ref, peer in zip(("out", *GRADIENTS), ours, exact, same_precision):
        errors[name] = (x.double() - ref).abs().max().item()
        baseline[name] = (peer.double() - ref).abs().max().item()
        magnitudes[name] = ref.abs().max().item()
    verdict = judge(w.spec.dtype, errors, baseline, magnitudes)
    if not verdict.ok:  # NaN fails too
        raise Rejected(f"not exact: {verdict.message} (seed {seed})")


def _out_and_grads(fn, q, k, v, dout):
    import torch

    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout.to(out.dtype)))


def main_tune(specs: list[Spec], args) -> int:
    """The CLI's `tune` command: tune, print the winners, and record them unless --dry-run."""
    values = [p.partition("=") for p in args.param or []]
    if any(not sep for _, sep, _ in values):
        raise AttngenError("--param takes NAME=VALUE")
    workloads = [Workload(spec, _params(spec, {name: value for name, _, value in values})) for spec in specs]
    start = time.monotonic()
    head_dims = args.head_dim or sorted({s.head_dim for s in specs})
    dtypes = args.dtype or sorted({s.dtype for s in specs})
    seqs = args.seq or [1024, 4096, 16384]
    recorded = 0
    for entry in tune(workloads, head_dims, dtypes, seqs, args.quick, kernels=tuple(args.kernel or ())):
        if not args.dry_run:  # each as it is found: a later failure loses none
            write_tuned_table([entry])
            recorded += 1
    if args.dry_run:
        print(f"tuned in {time.monotonic() - start:.0f} s (dry run: {TUNED_TABLE} unchanged)")
    else:
        print(f"tuned in {time.monotonic() - start:.0f} s; recorded {recorded} entries in {TUNED_TABLE}")
    return 0


def _params(spec: Spec, given: dict[str, str]) -> dict:
    """The spec's params from --param NAME=VALUE strings, typed as the spec declares them."""
    params = {}
    for p in spec.params:
        if p.is_tensor:
            raise AttngenError(
                f"{spec.path}: param {p.name} is a tensor ({p.declared}); attngen tune takes scalar params only:"
                " tune a spec of the same head_dim and dtype without tensors (the tuned table is shared)"
            )
        if p.name not in given:
            raise AttngenError(f"{spec.path}: give a value for each param to tune with: --param {p.name}=VALUE")
        try:
            params[p.name] = int(given[p.name]) if p.type.value == "int" else float(given[p.name])
        except ValueError:
            raise AttngenError(f"--param {p.name}={given[p.name]}: {p.name} is declared {p.type.value}") from None
    return params
