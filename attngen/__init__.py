"""attngen: a compiler for tiled (flash) attention variants.

Pipeline (one module or folder per stage, data flows one way):
    spec.py (TOML -> Spec) -> lang/ (expressions -> AST -> typed IR, ir.py)
    -> analysis/ (mask -> tile bounds, sympy) -> plan.py (KernelPlan per target, backends/)
    -> build.py (Jinja templates -> generated/<name>/); reference.py is the float64 oracle.
"""

from attngen.errors import AttngenError, SpecError
from attngen.spec import Spec, load_spec, parse_spec

__all__ = ["AttngenError", "Spec", "SpecError", "load_spec", "parse_spec"]
