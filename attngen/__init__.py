"""attngen: a compiler for tiled (flash) attention variants.

Pipeline (one module or folder per stage, data flows one way):
    spec/ (TOML -> Spec) -> lang/ (expressions -> AST -> typed IR, ir.py; ir_sympy.py)
    -> analysis/ (mask -> tile bounds per kernel, score -> derivative; sympy)
    -> plan.py (KernelPlan per target; each target and its kernels declared in backends/)
    -> build.py (templates/ -> generated/<name>/) -> check/ (ahead-of-time compile), tune.py.
reference.py is the float64 oracle, exactness.py the rule that judges kernels against it.
"""

from attngen.errors import AttngenError, SpecError
from attngen.spec import Spec, load_spec, parse_spec

__all__ = ["AttngenError", "Spec", "SpecError", "load_spec", "parse_spec"]
