"""The keys a spec may hold and their types, the names it may use, and its param declarations.

The top level, [mask], [score] and [params] are attngen's own; each target declares its table
([triton], [pallas_tpu]) and checks its values itself (attngen.backends).
"""

from __future__ import annotations

import datetime
import difflib
import keyword
import re
from typing import Any

from attngen.backends import TARGETS
from attngen.errors import shown
from attngen.spec.model import MAX_TENSOR_RANK, PARAM_TYPES, RESERVED_NAMES, TENSOR_TYPES, Param

# Whole-string patterns (fullmatch: `$` would also accept a trailing newline). ASCII only, so a
# look-alike letter from another script is not a letter here.
NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}", re.ASCII)
IDENT_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}", re.ASCII)

# key -> (expected python type, description) for each table.
SCHEMA: dict[str | None, dict[str, tuple[type | tuple[type, ...], str]]] = {
    None: {
        "name": (str, "a string"),
        "head_dim": (int, "an integer"),
        "head_dim_v": (int, "an integer"),
        "dtype": (str, "a string"),
    },
    "mask": {"causal": ((bool, str), 'true, false, "top_left" or "bottom_right"'), "expr": (str, "a string")},
    "score": {"expr": (str, "a string")},
    "sink": {"expr": (str, "a string")},
    "grad": {"params": (list, "an array of param names")},
    **{target.config_table: {key: (int, "an integer") for key in target.config_keys} for target in TARGETS},
}
TABLES = (*(t for t in SCHEMA if t is not None), "params")


def closest_key(key: str, keys: list[str]) -> str | None:
    """The key of `keys` that `key` most likely misspells (head_dims, haed_dim, block-m), or None."""
    close = difflib.get_close_matches(key.lower().replace("-", "_"), keys, n=1, cutoff=0.7)
    return close[0] if close else None


def described(value: Any) -> str:
    """A TOML value as a message shows it: short, in TOML's terms, with nothing unprintable."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return shown(repr(value), 40)
    if isinstance(value, (int, float)):
        return shown(str(value), 40)
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, (datetime.date, datetime.time)):  # datetime is a date
        return f"a date/time ({value.isoformat()})"
    return shown(repr(value), 40)


# What a hint shows for a key of the wrong type: its value in specs/ where one is typical.
_EXAMPLES = {"name": '"causal"', "dtype": '"bfloat16"', "expr": '"q_idx >= kv_idx"', "causal": "true"}


def example(key: str, wanted: type | tuple[type, ...]) -> str:
    value = _EXAMPLES[key] if key in _EXAMPLES else {int: "128", str: '"..."', bool: "true"}[wanted]
    return f"e.g. {key} = {value}"


def param_name_problem(name: str) -> str | None:
    """Why `name` cannot be a param (the hint of the error), or None."""
    if not IDENT_RE.fullmatch(name):
        return "use ASCII letters, digits and _, starting with a letter (at most 64 characters)"
    if keyword.iskeyword(name):
        return "this is a Python keyword"
    if name in RESERVED_NAMES:
        return f"`{name}` is a name of the expression language or of the generated functions"
    return None


_TENSOR_TYPE_RE = re.compile(r"(int|float|bool)\[([^\]]*)\]", re.ASCII)
_DIM_RE = re.compile(r"[1-9][0-9]{0,9}|[A-Za-z][A-Za-z0-9_]{0,63}", re.ASCII)


def param_declared(name: str, declared: Any) -> tuple[Param | None, str | None]:
    """The Param a [params] entry declares, or why it declares none."""
    if not isinstance(declared, str):
        return None, f'the type must be a string such as "int", got {described(declared)}'
    if declared in PARAM_TYPES:
        return Param(name, PARAM_TYPES[declared]), None
    m = _TENSOR_TYPE_RE.fullmatch(declared.replace(" ", ""))
    if not m:
        return None, (
            f'the type must be "int", "float", "int[axes]", "float[axes]" or "bool[axes]", got {described(declared)}'
        )
    dims = m.group(2).split(",")
    if not 1 <= len(dims) <= MAX_TENSOR_RANK:
        return None, f"a tensor has 1 to {MAX_TENSOR_RANK} axes, got {len(dims)}"
    shape = []
    for dim in dims:
        if not _DIM_RE.fullmatch(dim) or keyword.iskeyword(dim):
            return None, f"axis {described(dim)} is neither a positive int nor a size name"
        shape.append(int(dim) if dim.isdigit() else dim)
    if any(isinstance(d, int) and d > 2**31 - 1 for d in shape):
        return None, "an axis does not fit in int32"
    return Param(name, TENSOR_TYPES[m.group(1)], tuple(shape)), None
