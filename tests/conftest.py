"""Test set-up shared by every test module.

* TRITON_INTERPRET=1 before anything imports triton: kernels run on the CPU through Triton's
  interpreter (triton.jit reads it when a kernel is decorated).
* Hypothesis profiles: "ci" (derandomized, no example database, no deadline) is the default; "dev"
  draws fresh examples; "long" draws many. Pick one with HYPOTHESIS_PROFILE.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, Phase, settings

_COMMON = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}
# CI skips shrinking: kernel examples are slow to re-run, and the unshrunk example is printed.
_NO_SHRINK = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.explain]
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, phases=_NO_SHRINK, **_COMMON)
settings.register_profile("dev", print_blob=True, **_COMMON)
settings.register_profile("long", max_examples=1000, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
