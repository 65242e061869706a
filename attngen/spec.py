"""Stage: a spec file (TOML) -> a validated, frozen Spec holding typed IR.

Goals: read every key the user may write, check each against the targets' constraints, parse
and type-check the expressions, and report *every* problem at once with file:line:col.
Non-goals: no analysis of what the mask means (attngen.analysis) and no code generation.
"""

from __future__ import annotations

import hashlib
import keyword
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attngen import ir
from attngen.backends.pallas_tpu import DEFAULT_VMEM_LIMIT, vmem_estimate
from attngen.errors import Diagnostic, Location, SpecError
from attngen.lang import parser
from attngen.lang.typecheck import Scope, typecheck

DTYPES = ("float16", "bfloat16", "float32")
PARAM_TYPES = {"int": ir.Type.INT, "float": ir.Type.FLOAT}
CAUSAL_MASK = "q_idx >= kv_idx"

# Names a param may not take: the language's own, the generated functions' arguments, and the
# names the kernels use internally.
RESERVED_NAMES = frozenset(
    {*ir.INDEX_VARS, "score", "where", *ir.FUNCTIONS, "q", "k", "v", "scale", "return_lse", "interpret"}
)
_NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_IDENT_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")


@dataclass(frozen=True)
class Param:
    """A runtime scalar argument declared in [params]."""

    name: str
    type: ir.Type


@dataclass(frozen=True)
class TritonConfig:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    # The dK/dV kernel holds a q and a dO tile per pipeline stage: 3 stages of 128 x 128 bf16
    # tiles overflow the 227 KiB of shared memory an H100/H200 block may use.
    bwd_num_stages: int = 2


@dataclass(frozen=True)
class PallasTpuConfig:
    block_q: int = 512
    block_kv: int = 512
    vmem_limit_bytes: int | None = None  # None: Mosaic's default scoped VMEM limit


@dataclass(frozen=True)
class Spec:
    name: str
    head_dim: int
    dtype: str
    mask: ir.Expr | None  # None: every key visible
    score: ir.Expr | None  # None: the score is the scaled logit itself
    params: tuple[Param, ...]
    triton: TritonConfig
    pallas_tpu: PallasTpuConfig
    path: str
    sha256: str
    mask_source: str | None = None
    score_source: str | None = None


# key -> (expected python type, description) for each table.
_SCHEMA: dict[str | None, dict[str, tuple[type, str]]] = {
    None: {"name": (str, "a string"), "head_dim": (int, "an integer"), "dtype": (str, "a string")},
    "mask": {"causal": (bool, "true or false"), "expr": (str, "a string")},
    "score": {"expr": (str, "a string")},
    "triton": {k: (int, "an integer") for k in ("block_m", "block_n", "num_warps", "num_stages", "bwd_num_stages")},
    "pallas_tpu": {k: (int, "an integer") for k in ("block_q", "block_kv", "vmem_limit_bytes")},
}
_TABLES = (*(t for t in _SCHEMA if t is not None), "params")


class _Locator:
    """Finds where keys and values sit in the TOML text (tomllib keeps no positions)."""

    _HEADER = re.compile(r"^\s*\[\s*([A-Za-z0-9_\-]+)\s*\]")
    _KEY = re.compile(r"^(\s*)([A-Za-z0-9_\-]+)\s*=\s*")

    def __init__(self, path: str, text: str):
        self.path = path
        self.lines = text.splitlines()
        self.keys: dict[tuple[str | None, str], tuple[int, int, int]] = {}
        self.tables: dict[str, int] = {}
        table = None
        for number, line in enumerate(self.lines, start=1):
            if m := self._HEADER.match(line):
                table = m.group(1)
                self.tables.setdefault(table, number)
            elif m := self._KEY.match(line):
                self.keys.setdefault((table, m.group(2)), (number, len(m.group(1)) + 1, m.end() + 1))

    def _at(self, line: int, col: int) -> Location:
        source = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        return Location(self.path, line, col, source)

    def key(self, table: str | None, key: str) -> Location | None:
        if (table, key) in self.keys:
            line, col, _ = self.keys[(table, key)]
            return self._at(line, col)
        return self.table(table)

    def value(self, table: str | None, key: str, offset: int = 0) -> Location | None:
        """Location of character `offset` inside a one-line string value (after its quote)."""
        if (table, key) not in self.keys:
            return self.table(table)
        line, _, value_col = self.keys[(table, key)]
        return self._at(line, value_col + 1 + offset)

    def table(self, table: str | None) -> Location | None:
        if table in self.tables:
            return self._at(self.tables[table], 1)
        return None


@dataclass
class _Validator:
    loc: _Locator
    problems: list[Diagnostic] = field(default_factory=list)

    def error(self, message: str, where: Location | None, hint: str | None = None, width: int = 1) -> None:
        self.problems.append(Diagnostic(message, where, hint, width))

    def table(self, data: dict[str, Any], name: str) -> dict[str, Any]:
        value = data.get(name, {})
        if not isinstance(value, dict):
            self.error(f"`{name}` must be a table ([{name}])", self.loc.key(None, name))
            return {}
        return value

    def typed(self, data: dict[str, Any], table: str | None) -> dict[str, Any]:
        """The entries of data that have the schema's type; reports unknown keys and wrong types."""
        schema = _SCHEMA[table]
        out = {}
        for key, value in data.items():
            if table is None and key in _TABLES:
                continue
            where = self.loc.key(table, key)
            if key not in schema:
                scope = f"[{table}]" if table else "the top level"
                allowed = [*schema, *(f"[{t}]" for t in _TABLES)] if table is None else list(schema)
                self.error(f"unknown key `{key}` in {scope}", where, f"allowed: {', '.join(allowed)}", len(key))
                continue
            wanted, description = schema[key]
            if type(value) is not wanted:  # bool is an int subclass: compare exactly
                self.error(f"`{key}` must be {description}, got {value!r}", where, width=len(key))
                continue
            out[key] = value
        return out

    def expression(self, text: str, table: str, scope: Scope, want: ir.Type) -> ir.Expr | None:
        try:
            node = parser.parse(text)
        except parser.ParseError as e:
            self.error(f"syntax error in [{table}] expr: {e}", self.loc.value(table, "expr", e.offset), width=e.width)
            return None
        expr, problems = typecheck(node, scope, want)
        for p in problems:
            width = max(1, p.span.end - p.span.start)
            self.error(p.message, self.loc.value(table, "expr", p.span.start), p.hint, width)
        return expr


def _position(d: Diagnostic) -> tuple[int, int]:
    return (d.location.line, d.location.col) if d.location else (0, 0)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def parse_spec(text: str, path: str = "<spec>") -> Spec:
    """Validate spec text; raises SpecError listing every problem."""
    loc = _Locator(path, text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"\(at line (\d+), column (\d+)\)", str(e))
        where = loc._at(int(m.group(1)), int(m.group(2))) if m else Location(path, 1, 1)
        raise SpecError([Diagnostic(f"invalid TOML: {str(e).split(' (at')[0]}", where)]) from None
    v = _Validator(loc)

    top = v.typed(data, None)
    name = top.get("name")
    if name is None and "name" not in data:
        v.error("missing `name`", Location(path, 1, 1), 'add e.g. name = "causal" (the package name under generated/)')
    elif name is not None and (not _NAME_RE.match(name) or keyword.iskeyword(name)):
        v.error(
            f"name {name!r} is not a valid package name",
            loc.value(None, "name"),
            "use lowercase letters, digits and _; start with a letter",
        )
    head_dim = top.get("head_dim")
    if head_dim is None and "head_dim" not in data:
        v.error("missing `head_dim`", Location(path, 1, 1), "add e.g. head_dim = 128")
    elif head_dim is not None and not 16 <= head_dim <= 256:
        v.error(f"head_dim {head_dim} is outside 16..256", loc.key(None, "head_dim"))
    dtype = top.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        v.error(f"dtype {dtype!r} is not supported", loc.value(None, "dtype"), f"use one of {', '.join(DTYPES)}")

    params = []
    raw_params = v.table(data, "params")
    for pname, ptype in raw_params.items():
        where = loc.key("params", pname)
        if not _IDENT_RE.match(pname) or keyword.iskeyword(pname) or pname in RESERVED_NAMES:
            v.error(
                f"param name {pname!r} is not allowed",
                where,
                "use an identifier that is not a keyword or a built-in name",
                len(pname),
            )
        elif ptype not in PARAM_TYPES:
            v.error(f'param `{pname}` must be "int" or "float", got {ptype!r}', where, width=len(pname))
        else:
            params.append(Param(pname, PARAM_TYPES[ptype]))
    scope_params = {p.name: p.type for p in params}

    mask_table = v.typed(v.table(data, "mask"), "mask")
    mask_source = mask_table.get("expr")
    if mask_table.get("causal") and mask_source is not None:
        v.error(
            "[mask] has both `causal` and `expr`",
            loc.key("mask", "causal"),
            f"write causal as part of expr: {CAUSAL_MASK}",
        )
    elif mask_table.get("causal"):
        mask_source = CAUSAL_MASK
    mask = None
    if mask_source is not None:
        mask = v.expression(mask_source, "mask", Scope(scope_params, allow_score=False), ir.Type.BOOL)

    score_source = v.typed(v.table(data, "score"), "score").get("expr")
    score = None
    if score_source is not None:
        score = v.expression(score_source, "score", Scope(scope_params, allow_score=True), ir.Type.FLOAT)

    used = (ir.variables(mask) if mask else frozenset()) | (ir.variables(score) if score else frozenset())
    for p in params:
        if p.name not in used:
            v.error(f"param `{p.name}` is declared but never used", loc.key("params", p.name), width=len(p.name))

    tri = v.typed(v.table(data, "triton"), "triton")
    for key in ("block_m", "block_n"):
        if key in tri and not (_power_of_two(tri[key]) and 16 <= tri[key] <= 256):
            v.error(
                f"triton {key} must be a power of two in 16..256, got {tri[key]}",
                loc.key("triton", key),
                width=len(key),
            )
    if "num_warps" in tri and tri["num_warps"] not in (1, 2, 4, 8, 16):
        v.error(f"triton num_warps must be 1, 2, 4, 8 or 16, got {tri['num_warps']}", loc.key("triton", "num_warps"))
    for key in ("num_stages", "bwd_num_stages"):
        if key in tri and not 1 <= tri[key] <= 8:
            v.error(f"triton {key} must be in 1..8, got {tri[key]}", loc.key("triton", key))

    tpu = v.typed(v.table(data, "pallas_tpu"), "pallas_tpu")
    # TPU tiles are (8 sublanes, 128 lanes): q rows are a sublane dim, kv a lane dim of the scores.
    if "block_q" in tpu and not (tpu["block_q"] % 8 == 0 and 8 <= tpu["block_q"] <= 4096):
        v.error(
            f"pallas_tpu block_q must be a multiple of 8 in 8..4096, got {tpu['block_q']}",
            loc.key("pallas_tpu", "block_q"),
            "TPU blocks are tiled by (8, 128)",
        )
    if "block_kv" in tpu and not (tpu["block_kv"] % 128 == 0 and 128 <= tpu["block_kv"] <= 4096):
        v.error(
            f"pallas_tpu block_kv must be a multiple of 128 in 128..4096, got {tpu['block_kv']}",
            loc.key("pallas_tpu", "block_kv"),
            "TPU blocks are tiled by (8, 128)",
        )

    if "vmem_limit_bytes" in tpu and not 1 << 20 <= tpu["vmem_limit_bytes"] <= 128 << 20:
        v.error("pallas_tpu vmem_limit_bytes must be in 1 MiB..128 MiB", loc.key("pallas_tpu", "vmem_limit_bytes"))
    elif head_dim is not None and dtype in DTYPES and not v.problems:
        config = PallasTpuConfig(**tpu)
        limit = config.vmem_limit_bytes or DEFAULT_VMEM_LIMIT
        itemsize = 4 if dtype == "float32" else 2
        for kernel, need in vmem_estimate(config.block_q, config.block_kv, head_dim, itemsize).items():
            if need > limit:
                v.error(
                    f"the Pallas {kernel} kernel needs about {need / 2**20:.1f} MiB of VMEM with block_q={config.block_q},"
                    f" block_kv={config.block_kv}; the scoped limit is {limit / 2**20:.0f} MiB",
                    loc.table("pallas_tpu") or Location(path, 1, 1),
                    "use a smaller block_kv or block_q, or raise vmem_limit_bytes",
                )
                break

    if v.problems:
        raise SpecError(sorted(v.problems, key=_position))
    return Spec(
        name=name,
        head_dim=head_dim,
        dtype=dtype,
        mask=mask,
        score=score,
        params=tuple(params),
        triton=TritonConfig(**tri),
        pallas_tpu=PallasTpuConfig(**tpu),
        path=path,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
        mask_source=mask_source,
        score_source=score_source,
    )


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError([Diagnostic(f"cannot read spec: {e}", Location(str(path), 1, 1))]) from None
    return parse_spec(text, str(path))
