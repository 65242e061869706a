"""Stage: a spec file (TOML) -> a validated, frozen Spec holding typed IR.

positions.py finds where each key and character sits in the text (for located errors),
schema.py says which keys and names a spec may hold, validate.py checks a spec and builds the
Spec of model.py. Each target checks its own table (attngen.backends). varlen.py derives a
spec's packed form (FlashAttention's variable-length interface), sharded.py its sharded form (one
block of a longer sequence, for context parallelism).
"""

from attngen.spec.model import CAUSAL_MASK, CAUSAL_MASKS, DTYPES, MAX_SPEC_BYTES, Param, Spec, retarget, with_config
from attngen.spec.sharded import sharded
from attngen.spec.validate import load_spec, parse_spec
from attngen.spec.varlen import packed

__all__ = [
    "CAUSAL_MASK",
    "CAUSAL_MASKS",
    "DTYPES",
    "MAX_SPEC_BYTES",
    "Param",
    "Spec",
    "load_spec",
    "packed",
    "parse_spec",
    "retarget",
    "sharded",
    "with_config",
]
