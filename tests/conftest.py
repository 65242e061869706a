"""Test set-up shared by every test module.

* TRITON_INTERPRET=1 before anything imports triton: kernels run on the CPU through Triton's
  interpreter (triton.jit reads it when a kernel is decorated).
* Hypothesis profiles: "ci" (derandomized, no example database, no deadline) is the default; "dev"
  draws fresh examples; "long" draws many. Pick one with HYPOTHESIS_PROFILE.
* Under pytest-xdist (pyproject's addopts: one worker per CPU), each worker's OpenMP and BLAS
  pools (torch, numpy) get its share of the CPUs, set before they start: one pool per worker, each
  as wide as the machine, contend for the cores (on 2 cores, 2 workers ran the Triton spec tests
  in 80 s against 35 s serially; 21 s with this). Workers are not pinned to CPUs: Pallas
  interpret mode's callbacks can deadlock on a jax CPU client with a single thread.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    _cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, str(max(1, _cpus // _XDIST_WORKERS)))

from hypothesis import HealthCheck, Phase, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
# CI skips shrinking: kernel examples are slow to re-run, and the unshrunk example is printed.
_NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.explain]
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, phases=_NO_SHRINK, **_COMMON)
settings.register_profile("dev", print_blob=True, **_COMMON)
settings.register_profile("long", max_examples=1000, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests run the kernels compiled for a CUDA GPU: skipped on CPU machines and under the
    interpreter (the README's command for them sets TRITON_INTERPRET=0)."""
    import pytest
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU and TRITON_INTERPRET=0")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
