"""Stage: a spec file (TOML) -> a validated, frozen Spec holding typed IR.

Goals: read every key the user may write, check each against the schema and the targets'
constraints, parse and type-check the expressions, and report *every* problem at once with
file:line:col. Any input -- bytes that are not UTF-8, TOML of any shape, values of any type --
ends in a Spec or a SpecError, never in another exception; only names that match a strict ASCII
pattern leave this stage, so nothing else a user writes can reach generated source.
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
from attngen.backends import TARGETS
from attngen.errors import Diagnostic, Location, SpecError, shown
from attngen.lang import parser
from attngen.lang.typecheck import Scope, typecheck
from attngen.spec.model import CAUSAL_MASKS, DTYPES, MAX_SPEC_BYTES, Spec, problem_shape
from attngen.spec.positions import Locator, Spot, TomlPositions
from attngen.spec.schema import (
    NAME_RE,
    SCHEMA,
    TABLES,
    closest_key,
    described,
    example,
    param_declared,
    param_name_problem,
)


@dataclass
class _Validator:
    loc: Locator
    problems: list[Diagnostic] = field(default_factory=list)

    def error(self, message: str, spot: Spot, hint: str | None = None) -> None:
        self.problems.append(Diagnostic(message, spot.location, hint, spot.width))

    def reporter(self, table: str):
        """A target's Report: problems at keys of its table (attngen.backends.base.Report)."""

        def report(message: str, key: str | None = None, hint: str | None = None) -> None:
            self.error(message, self.loc.key(table, key) if key else self.loc.key(table), hint)

        return report

    def table(self, data: dict[str, Any], name: str) -> dict[str, Any]:
        value = data.get(name, {})
        if not isinstance(value, dict):
            self.error(
                f"`{name}` must be a table ([{name}]), got {described(value)}",
                self.loc.key(name),
                f"write its keys under a [{name}] line",
            )
            return {}
        return value

    def typed(self, data: dict[str, Any], table: str | None) -> dict[str, Any]:
        """The entries of data that have the schema's type; reports unknown keys and wrong types."""
        schema = SCHEMA[table]
        out = {}
        for key, value in data.items():
            if table is None and key in TABLES:
                continue
            spot = self.loc.key(*(table,) * (table is not None), key)
            if key not in schema:
                scope = f"[{table}]" if table else "the top level"
                allowed = [*schema, *(f"[{t}]" for t in TABLES)] if table is None else list(schema)
                hint = f"allowed: {', '.join(allowed)}"
                if close := closest_key(key, [*schema, *TABLES] if table is None else list(schema)):
                    hint = f"did you mean `{f'[{close}]' if close in TABLES else close}`? {hint}"
                self.error(f"unknown key `{shown(key)}` in {scope}", spot, hint)
                continue
            wanted, description = schema[key]
            if type(value) not in (wanted if isinstance(wanted, tuple) else (wanted,)):  # exactly: bool is an int
                self.error(f"`{key}` must be {description}, got {described(value)}", spot, example(key, wanted))
                continue
            out[key] = value
        return out

    def expression(
        self, text: str, table: str, scope: Scope, want: ir.Type
    ) -> tuple[ir.Expr | None, frozenset[str] | None]:
        """The typed IR of an expression (None if it has problems) and the names it reads (None if
        it does not parse: then they are unknown)."""
        try:
            node = parser.parse(text)
        except parser.ParseError as e:
            spot = self.loc.value(table, "expr", start=e.offset, end=e.offset + e.width)
            self.error(f"syntax error in [{table}] expr: {e}", spot, e.hint)
            return None, None
        expr, problems = typecheck(node, scope, want)
        for p in problems:
            self.error(p.message, self.loc.value(table, "expr", start=p.span.start, end=p.span.end), p.hint)
        return expr, parser.names(node)


def _position(d: Diagnostic) -> tuple[int, int]:
    return (d.location.line, d.location.col) if d.location else (0, 0)


def _load_toml(text: str, loc: Locator) -> dict[str, Any]:
    """The TOML document; raises SpecError at the position tomllib names when it rejects it."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        message = str(e)
        if m := re.search(r"\(at line (\d+), column (\d+)\)$", message):
            spot = loc.line_col(int(m.group(1)), int(m.group(2)))
        else:  # "(at end of document)"
            spot = loc.at(len(text))
        problem = Diagnostic(f"invalid TOML: {shown(message.split(' (at ')[0], 120)}", spot.location)
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        problem = Diagnostic("invalid TOML: arrays or tables nested too deeply", loc.at(_deep_nesting(text)).location)
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        digits = re.search(r"[0-9_]{4000,}", text)
        spot = loc.at(digits.start() if digits else 0)
        problem = Diagnostic(f"invalid TOML: {shown(str(e).split(';')[0], 120)}", spot.location)
    raise SpecError([problem])


def _deep_nesting(text: str) -> int:
    """Offset of the first bracket that opens a 100th level (a guess where nesting went wrong)."""
    depth = 0
    for offset, c in enumerate(text):
        depth += (c in "[{") - (c in "]}")
        if depth >= 100:
            return offset
    return 0


def parse_spec(text: str, path: str = "<spec>") -> Spec:
    """Validate spec text; raises SpecError listing every problem."""
    loc = Locator(path, text)
    try:
        sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    except UnicodeEncodeError as e:  # a lone surrogate: only reachable through a str, not a file
        raise SpecError([Diagnostic("the spec is not valid Unicode (a lone surrogate)", loc.at(e.start).location)])
    data = _load_toml(text, loc)
    loc.toml = TomlPositions(text)
    v = _Validator(loc)

    top = v.typed(data, None)
    name = top.get("name")
    if name is None and "name" not in data:
        v.error("missing `name`", loc.start(), 'add e.g. name = "causal" (the package name under generated/)')
    elif name is not None and (not NAME_RE.fullmatch(name) or keyword.iskeyword(name)):
        v.error(
            f"name {described(name)} is not a valid package name",
            loc.value("name", end=len(name)),
            "use lowercase ASCII letters, digits and _; start with a letter (at most 64 characters)",
        )
    head_dim = top.get("head_dim")
    if head_dim is None and "head_dim" not in data:
        v.error("missing `head_dim`", loc.start(), "add e.g. head_dim = 128")
    for key, padded in (("head_dim", "q, k and v"), ("head_dim_v", "v")):
        size = top.get(key)
        if size is not None and not 16 <= size <= 256:
            v.error(f"{key} {described(size)} is outside 16..256", loc.key(key), f"e.g. {key} = 128")
        elif size is not None and size % 8:
            # The Triton kernels move tiles with tensor descriptors (TMA), whose rows are whole
            # 16-byte units: a head dim * 2 bytes must be a multiple of 16 (FlashAttention's rule too).
            v.error(
                f"{key} {size} is not a multiple of 8",
                loc.key(key),
                f"pad {padded} to {key} = {size + 8 - size % 8} (zeros change nothing but the scale)",
            )
    dtype = top.get("dtype", "bfloat16")
    if dtype not in DTYPES:
        v.error(
            f"dtype {described(dtype)} is not supported",
            loc.value("dtype", end=len(dtype)),
            f"use one of {', '.join(DTYPES)}",
        )

    params = []
    raw_params = v.table(data, "params")
    for pname, ptype in raw_params.items():
        spot = loc.key("params", pname)
        if hint := param_name_problem(pname):
            v.error(f"param name {described(pname)} is not allowed", spot, hint)
            continue
        param, problem = param_declared(pname, ptype)
        if problem:
            v.error(
                f"param `{pname}`: {problem}",
                spot,
                f'e.g. {pname} = "int" (a scalar) or {pname} = "float[heads, q_len]" (a tensor)',
            )
        else:
            params.append(param)
    scalars = {p.name: p.type for p in params if not p.is_tensor}
    tensors = {p.name: (p.type, len(p.shape)) for p in params if p.is_tensor}

    mask_table = v.typed(v.table(data, "mask"), "mask")
    mask_source = mask_table.get("expr")
    causal = mask_table.get("causal", False)
    if causal is not False and causal not in CAUSAL_MASKS:
        v.error(
            f'causal must be true, false, "top_left" or "bottom_right", got {described(causal)}',
            loc.key("mask", "causal"),
        )
    elif causal is not False and mask_source is not None:
        v.error(
            "[mask] has both `causal` and `expr`",
            loc.key("mask", "causal"),
            f"write causal as part of expr: {CAUSAL_MASKS[causal]}",
        )
    elif causal is not False:
        mask_source = CAUSAL_MASKS[causal]
    mask, mask_names = None, frozenset()
    if mask_source is not None:
        mask, mask_names = v.expression(
            mask_source, "mask", Scope(scalars, allow_score=False, tensors=tensors), ir.Type.BOOL
        )
    score_source = v.typed(v.table(data, "score"), "score").get("expr")
    score, score_names = None, frozenset()
    if score_source is not None:
        score, score_names = v.expression(
            score_source, "score", Scope(scalars, allow_score=True, tensors=tensors), ir.Type.FLOAT
        )
    sink_source = v.typed(v.table(data, "sink"), "sink").get("expr")
    sink, sink_names = None, frozenset()
    if sink_source is not None:
        sink, sink_names = v.expression(
            sink_source, "sink", Scope(scalars, allow_score=False, tensors=tensors), ir.Type.FLOAT
        )
        per_row = sorted((sink_names or frozenset()) & {"q_idx", "kv_idx", "q_len", "kv_len"})
        if per_row:
            v.error(
                f"[sink] expr reads {', '.join(per_row)}: a sink is one logit per batch and head",
                loc.value("sink", "expr"),
                'read b, h and params, e.g. expr = "sinks[h]" with sinks = "float[heads]"',
            )
            sink = None
    if None not in (mask_names, score_names, sink_names):  # else which names are read is unknown
        for p in params:
            if p.name not in mask_names | score_names | sink_names:
                v.error(
                    f"param `{p.name}` is declared but never used",
                    loc.key("params", p.name),
                    "read it in the [mask], [score] or [sink] expr, or remove it",
                )

    grad_params = v.typed(v.table(data, "grad"), "grad").get("params", [])
    declared = {p.name: p for p in params}
    for pname in grad_params:
        problem = None
        if not isinstance(pname, str) or pname not in declared:
            problem = f"{described(pname)} is not a declared param"
        elif not declared[pname].is_tensor or declared[pname].type is not ir.Type.FLOAT:
            problem = f"`{pname}` is {declared[pname].declared}: only float tensors get gradients"
        elif pname in (sink_names or ()):
            problem = f"`{pname}` is read by the [sink] expr, and gets its gradient through the sink already"
        elif score_names is not None and pname not in score_names:
            problem = f"`{pname}` is not read in the [score] expr"
        if problem:
            v.error(
                f"[grad] params: {problem}",
                loc.key("grad", "params"),
                "list float tensor params the [score] expr reads",
            )
    if len(set(map(str, grad_params))) != len(grad_params):
        v.error("[grad] params names a param twice", loc.key("grad", "params"))

    # Each target checks its own table; what depends on the shape, only once the shape is valid.
    shape = None
    if not v.problems:
        shape = problem_shape(head_dim, top.get("head_dim_v") or head_dim, dtype, mask, score, tuple(grad_params))
    tables, configs = {}, {}
    for target in TARGETS:
        tables[target.name] = v.typed(v.table(data, target.config_table), target.config_table)
        configs[target.name] = target.make_config(tables[target.name], shape, v.reporter(target.config_table))

    if v.problems:
        raise SpecError(sorted(v.problems, key=_position))
    return Spec(
        name=name,
        head_dim=head_dim,
        head_dim_v=top.get("head_dim_v"),
        dtype=dtype,
        mask=mask,
        score=score,
        params=tuple(params),
        tables=tables,
        configs=configs,
        path=path,
        sha256=sha256,
        mask_source=mask_source,
        sink=sink,
        grad_params=tuple(grad_params),
    )


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file (UTF-8; a byte-order mark is allowed)."""
    path = Path(path)
    where = Location(str(path), 1, 1)
    try:
        if path.exists() and not path.is_file():  # a folder, or a FIFO that would block a read
            kind = "a folder" if path.is_dir() else "not a regular file"
            raise SpecError([Diagnostic(f"cannot read spec: it is {kind}", where)])
        with path.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise SpecError([Diagnostic(f"cannot read spec: {shown(e.strerror or str(e), 200)}", where)]) from None
    except ValueError as e:  # a path no file system takes (a NUL byte)
        raise SpecError([Diagnostic(f"cannot read spec: {e}", where)]) from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError([Diagnostic(f"the spec is larger than {MAX_SPEC_BYTES >> 20} MiB", where)])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        text = data.decode("utf-8", "replace")
        bad = len(data[: e.start].decode("utf-8", "replace"))
        spot = Locator(str(path), text).at(bad)
        raise SpecError(
            [Diagnostic(f"the spec is not UTF-8: byte 0x{data[e.start]:02x}", spot.location, "save it as UTF-8")]
        ) from None
    return parse_spec(text.removeprefix("\ufeff"), str(path))
