"""attngen: a compiler for tiled (flash) attention variants.

Pipeline (one module or folder per stage, data flows one way):
    spec/ (TOML -> Spec) -> lang/ (expressions -> AST -> typed IR, ir.py; ir_sympy.py)
    -> analysis/ (mask -> tile bounds per kernel, score -> derivative; sympy)
    -> plan.py (KernelPlan per target; each target and its kernels declared in backends/)
    -> build.py (templates/ -> generated/<name>/) -> check/ (ahead-of-time compile), tune.py;
    parallel/ runs a spec's sharded form (spec/sharded.py) over devices (context parallelism).
reference.py is the float64 oracle, exactness.py the rule that judges kernels against it.
"""

from importlib.metadata import PackageNotFoundError, version

from attngen.build import load
from attngen.errors import AttngenError, SpecError
from attngen.spec import Spec, load_spec, parse_spec

try:
    __version__ = version("attngen")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"

__all__ = ["AttngenError", "Spec", "SpecError", "__version__", "load", "load_spec", "parse_spec"]
