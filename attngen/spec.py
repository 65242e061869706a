"""Stage: a spec file (TOML) -> a validated, frozen Spec holding typed IR.

Goals: read every key the user may write, check each against the targets' constraints, parse
and type-check the expressions, and report *every* problem at once with file:line:col. Any
input -- bytes that are not UTF-8, TOML of any shape, values of any type -- ends in a Spec or a
SpecError, never in another exception; only names that match a strict ASCII pattern leave this
stage, so nothing else a user writes can reach generated source.
Non-goals: no analysis of what the mask means (attngen.analysis) and no code generation.
"""

from __future__ import annotations

import bisect
import datetime
import hashlib
import keyword
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from attngen import ir
from attngen.backends.pallas_tpu import DEFAULT_VMEM_LIMIT, vmem_estimate
from attngen.backends.triton_gpu import default_config as default_triton_config
from attngen.errors import Diagnostic, Location, SpecError, shown
from attngen.lang import parser
from attngen.lang.typecheck import Scope, typecheck

DTYPES = ("float16", "bfloat16", "float32")
PARAM_TYPES = {"int": ir.Type.INT, "float": ir.Type.FLOAT}
# Axis names of a tensor param that stand for the attention problem's own sizes; any other name
# is a size of the caller's choosing (the same name is the same size in every tensor).
SIZE_NAMES = ("batch", "heads", "kv_heads", "q_len", "kv_len")
MAX_TENSOR_RANK = 4
CAUSAL_MASK = "q_idx >= kv_idx"
# `causal` in [mask]: how the diagonal sits when q_len != kv_len. Top-left: query i sees keys
# 0..i. Bottom-right (FlashAttention >= 2.1): the last query sees every key, as when the queries
# are the last q_len of kv_len positions (decoding with a cache, chunked prefill).
CAUSAL_MASKS = {True: CAUSAL_MASK, "top_left": CAUSAL_MASK, "bottom_right": "q_idx + kv_len - q_len >= kv_idx"}

# Names a param may not take: the language's own, the generated functions' arguments, and the
# names the kernels use internally.
RESERVED_NAMES = frozenset(
    {*ir.INDEX_VARS, *ir.SIZE_VARS, "score", "where", *ir.FUNCTIONS, "q", "k", "v", "scale", "return_lse", "interpret"}
)
# Whole-string patterns (fullmatch: `$` would also accept a trailing newline). ASCII only, so a
# look-alike letter from another script is not a letter here.
_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,63}", re.ASCII)
_IDENT_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}", re.ASCII)
MAX_SPEC_BYTES = 1 << 20  # a spec is a few hundred bytes; this bounds what a stray path can cost


@dataclass(frozen=True)
class Param:
    """A runtime argument declared in [params]: a scalar, or a tensor of `shape` (axis sizes: an
    int, a name of SIZE_NAMES, or a free size name) that expressions index."""

    name: str
    type: ir.Type
    shape: tuple[int | str, ...] = ()  # () for a scalar

    @property
    def is_tensor(self) -> bool:
        return bool(self.shape)

    @property
    def declared(self) -> str:
        """The type as written in [params], e.g. "float[heads, buckets]"."""
        dims = ", ".join(map(str, self.shape))
        return f"{self.type.value}[{dims}]" if self.shape else self.type.value


@dataclass(frozen=True)
class TritonConfig:
    """Tile sizes and pipelining of the Triton kernels; unset keys come from the tuned table
    (attngen.backends.triton_gpu.default_config)."""

    # Forward: block_m queries per program, block_n keys per step.
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Forward over short key sequences (kv_len <= short_kv_len): programs that see few keys pay
    # their prologue and epilogue in full, so smaller tiles that let two programs share an SM win.
    short_kv_len: int
    short_block_m: int
    short_block_n: int
    short_num_warps: int
    short_num_stages: int
    # Backward: the dQ kernel holds dq_block_m queries and steps over dq_block_n keys; the dK/dV
    # kernel holds dkdv_block_n keys and steps over dkdv_block_m queries.
    dq_block_m: int
    dq_block_n: int
    dq_num_warps: int
    dq_num_stages: int
    dkdv_block_m: int
    dkdv_block_n: int
    dkdv_num_warps: int
    dkdv_num_stages: int


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
    triton_pinned: tuple[str, ...] = ()  # the [triton] keys the spec sets; the rest are defaults
    head_dim_v: int | None = None  # v's (and the output's) head dim, when it differs from q's and k's

    @property
    def value_dim(self) -> int:
        """The head dim of v and of the output."""
        return self.head_dim_v or self.head_dim


def retarget(spec: Spec, head_dim: int, dtype: str) -> Spec:
    """The spec at another head_dim and dtype, its unpinned [triton] keys re-defaulted (for tools
    that sweep shapes, such as the benchmarks)."""
    pinned = {key: getattr(spec.triton, key) for key in spec.triton_pinned}
    triton = triton_config(max(head_dim, spec.head_dim_v or 0), dtype, pinned)
    return replace(spec, head_dim=head_dim, dtype=dtype, triton=triton)


def triton_config(head_dim: int, dtype: str, pinned: dict[str, int]) -> TritonConfig:
    """The spec's [triton] keys over the tuned table's entry for its head_dim and dtype. Forward
    tiles pinned without short_* keys are pinned for every length: no short-sequence forward."""
    config = {**default_triton_config(head_dim, dtype), **pinned}
    if pinned.keys() & {"block_m", "block_n", "num_warps", "num_stages"} and not any(
        k.startswith("short_") for k in pinned
    ):
        config["short_kv_len"] = 0
    return TritonConfig(**config)


Key = tuple[str, ...]  # a dotted key path, e.g. ("mask", "expr")

# key -> (expected python type, description) for each table.
_SCHEMA: dict[str | None, dict[str, tuple[type | tuple[type, ...], str]]] = {
    None: {
        "name": (str, "a string"),
        "head_dim": (int, "an integer"),
        "head_dim_v": (int, "an integer"),
        "dtype": (str, "a string"),
    },
    "mask": {"causal": ((bool, str), 'true, false, "top_left" or "bottom_right"'), "expr": (str, "a string")},
    "score": {"expr": (str, "a string")},
    "triton": {k: (int, "an integer") for k in (f.name for f in fields(TritonConfig))},
    "pallas_tpu": {k: (int, "an integer") for k in ("block_q", "block_kv", "vmem_limit_bytes")},
}
_TABLES = (*(t for t in _SCHEMA if t is not None), "params")
# TOML's escapes in basic strings (\e and \xHH are TOML 1.1, which newer tomllib reads).
_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", "e": "\x1b", '"': '"', "\\": "\\"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class _TomlPositions:
    """Where each key of a TOML text sits, and where each character of its string values came from.

    tomllib keeps no positions. This scanner runs only on text tomllib has accepted and follows
    the TOML grammar just far enough to record, for every dotted key path, the span of its key
    (or table header) and, for a string value, the source offset of each decoded character (escapes
    and multi-line strings make the two differ). It never raises: on anything it does not expect
    it stops, and what it has recorded so far stays usable.
    """

    def __init__(self, text: str):
        self.text = text
        self.pos = 0
        self.keys: dict[Key, tuple[int, int]] = {}  # path -> [start, end) of its key or header
        self.strings: dict[Key, list[int]] = {}  # path -> offset of each decoded char, then of the end quote
        self._document()

    def _peek(self, n: int = 1) -> str:
        return self.text[self.pos : self.pos + n]

    def _skip(self, chars: str) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in chars:
            self.pos += 1

    def _skip_space(self, newlines: bool) -> None:
        """Skip blanks and comments, and line ends too if `newlines`."""
        while self.pos < len(self.text):
            self._skip(" \t\r\n" if newlines else " \t")
            if self._peek() != "#":
                return
            end = self.text.find("\n", self.pos)
            self.pos = len(self.text) if end < 0 else end

    def _document(self) -> None:
        table: Key = ()
        while True:
            self._skip_space(newlines=True)
            start = self.pos
            if start >= len(self.text):
                return
            if self._peek() == "[":
                brackets = 2 if self._peek(2) == "[[" else 1
                self.pos += brackets
                table, _ = self._key()
                self._skip(" \t")
                self.pos += brackets
                self.keys.setdefault(table, (start, self.pos))
            else:
                self._key_value(table)
            if self.pos <= start:  # not TOML as this scanner knows it: keep what it found
                return

    def _key_value(self, table: Key | None) -> None:
        """`a.b = value` inside `table` (None: inside an array, not recorded)."""
        start = self.pos
        parts, end = self._key()
        path = None if table is None else (*table, *parts)
        if path is not None:
            for n in range(len(table) + 1, len(path) + 1):  # a.b.c = 1 also defines tables a and a.b
                self.keys.setdefault(path[:n], (start, end))
        self._skip(" \t")
        if self._peek() != "=":
            self.pos = len(self.text)
            return
        self.pos += 1
        self._skip(" \t")
        self._value(path)

    def _key(self) -> tuple[Key, int]:
        """A dotted key; returns its parts and the offset after its last part."""
        parts = []
        while True:
            self._skip(" \t")
            if self._peek() in ('"', "'"):
                parts.append(self._string()[0])
            else:
                start = self.pos
                self._skip("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
                parts.append(self.text[start : self.pos])
            end = self.pos
            self._skip(" \t")
            if self._peek() != ".":
                return tuple(parts), end
            self.pos += 1

    def _value(self, path: Key | None) -> None:
        """Skip one value, recording string positions (path None: inside an array, not recorded)."""
        c = self._peek()
        if c in ('"', "'"):
            _, offsets = self._string()
            if path is not None:
                self.strings.setdefault(path, offsets)
        elif c in ("[", "{"):
            self.pos += 1
            close = "]" if c == "[" else "}"
            while self.pos < len(self.text):
                self._skip_space(newlines=True)
                before = self.pos
                if self._peek() == close:
                    self.pos += 1
                    return
                if c == "[":
                    self._value(None)
                else:
                    self._key_value(path)
                self._skip_space(newlines=True)
                if self._peek() == ",":
                    self.pos += 1
                if self.pos <= before:
                    self.pos = len(self.text)
        else:  # number, bool, date or time (a space may separate a date from its time)
            while self.pos < len(self.text) and self.text[self.pos] not in ",]}#\r\n":
                self.pos += 1

    def _string(self) -> tuple[str, list[int]]:
        """One string of any of TOML's four kinds: its value and the source offset of each of its
        characters, then of its closing quote."""
        quote = self._peek()
        multi = self._peek(3) == quote * 3
        basic = quote == '"'
        self.pos += 3 if multi else 1
        if multi:  # a line end right after the opening quotes is not part of the value
            self.pos += 2 if self._peek(2) == "\r\n" else self._peek() == "\n"
        chars, offsets = [], []
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c == quote and (not multi or self._peek(3) == quote * 3):
                run = 1
                while multi and self.text[self.pos + run : self.pos + run + 1] == quote:
                    run += 1
                for _ in range(run - 3 if multi else 0):  # quotes just before the closing three
                    chars.append(quote)
                    offsets.append(self.pos)
                    self.pos += 1
                offsets.append(self.pos)
                self.pos += 3 if multi else 1
                return "".join(chars), offsets
            start = self.pos
            if basic and c == "\\":
                escape = self.text[self.pos + 1 : self.pos + 2]
                if escape in _HEX_ESCAPES:
                    digits = self.text[self.pos + 2 : self.pos + 2 + _HEX_ESCAPES[escape]]
                    chars.append(chr(int(digits, 16)) if _is_hex_codepoint(digits) else "\ufffd")
                    self.pos += 2 + len(digits)
                elif escape in _ESCAPES:
                    chars.append(_ESCAPES[escape])
                    self.pos += 2
                else:  # a line-ending backslash: the line end and the blanks after it vanish
                    self.pos += 1
                    self._skip(" \t\r\n")
                    continue
            elif multi and self._peek(2) == "\r\n":  # tomllib reads a CRLF inside a string as "\n"
                chars.append("\n")
                self.pos += 2
            else:
                chars.append(c)
                self.pos += 1
            offsets.append(start)
        offsets.append(self.pos)
        return "".join(chars), offsets


def _is_hex_codepoint(digits: str) -> bool:
    return bool(digits) and all(c in "0123456789abcdefABCDEF" for c in digits) and int(digits, 16) <= 0x10FFFF


@dataclass(frozen=True)
class _Spot:
    """Where a problem is and how many characters of it to underline."""

    location: Location
    width: int = 1


class _Locator:
    """Source positions for a spec's text: offsets, keys and characters inside string values."""

    def __init__(self, path: str, text: str):
        self.path = path
        # Lines end at "\n" only, as TOML (and tomllib's error positions) count them.
        self.lines = [line.removesuffix("\r") for line in text.split("\n")]
        self.line_starts = [0]
        for line in text.split("\n")[:-1]:
            self.line_starts.append(self.line_starts[-1] + len(line) + 1)
        self.toml: _TomlPositions | None = None  # filled in once tomllib has accepted the text

    def at(self, offset: int, width: int = 1) -> _Spot:
        line = bisect.bisect_right(self.line_starts, offset)
        col = offset - self.line_starts[line - 1] + 1
        return _Spot(Location(self.path, line, col, self.lines[line - 1]), width)

    def line_col(self, line: int, col: int) -> _Spot:
        line = min(max(line, 1), len(self.lines))
        return self.at(self.line_starts[line - 1] + max(col, 1) - 1)

    def start(self) -> _Spot:
        return self.at(0)

    def key(self, *path: str) -> _Spot:
        """The key at `path`, else its nearest enclosing table, else the start of the file."""
        keys = self.toml.keys if self.toml else {}
        for n in range(len(path), 0, -1):
            if path[:n] in keys:
                start, end = keys[path[:n]]
                return self.at(start, end - start)
        return self.start()

    def value(self, *path: str, start: int = 0, end: int | None = None) -> _Spot:
        """Characters [start, end) of the string value at `path` (the key if it has none)."""
        offsets = self.toml.strings.get(path) if self.toml else None
        if offsets is None:
            return self.key(*path)
        first = offsets[min(start, len(offsets) - 1)]
        last = offsets[min(end, len(offsets) - 1)] if end is not None else first + 1
        return self.at(first, last - first)


def _described(value: Any) -> str:
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


@dataclass
class _Validator:
    loc: _Locator
    problems: list[Diagnostic] = field(default_factory=list)

    def error(self, message: str, spot: _Spot, hint: str | None = None) -> None:
        self.problems.append(Diagnostic(message, spot.location, hint, spot.width))

    def table(self, data: dict[str, Any], name: str) -> dict[str, Any]:
        value = data.get(name, {})
        if not isinstance(value, dict):
            self.error(
                f"`{name}` must be a table ([{name}]), got {_described(value)}",
                self.loc.key(name),
                f"write its keys under a [{name}] line",
            )
            return {}
        return value

    def typed(self, data: dict[str, Any], table: str | None) -> dict[str, Any]:
        """The entries of data that have the schema's type; reports unknown keys and wrong types."""
        schema = _SCHEMA[table]
        out = {}
        for key, value in data.items():
            if table is None and key in _TABLES:
                continue
            spot = self.loc.key(*(table,) * (table is not None), key)
            if key not in schema:
                scope = f"[{table}]" if table else "the top level"
                allowed = [*schema, *(f"[{t}]" for t in _TABLES)] if table is None else list(schema)
                self.error(f"unknown key `{shown(key)}` in {scope}", spot, f"allowed: {', '.join(allowed)}")
                continue
            wanted, description = schema[key]
            if type(value) not in (wanted if isinstance(wanted, tuple) else (wanted,)):  # exactly: bool is an int
                self.error(f"`{key}` must be {description}, got {_described(value)}", spot, _example(key, wanted))
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
            self.error(f"syntax error in [{table}] expr: {e}", spot)
            return None, None
        expr, problems = typecheck(node, scope, want)
        for p in problems:
            self.error(p.message, self.loc.value(table, "expr", start=p.span.start, end=p.span.end), p.hint)
        return expr, parser.names(node)


# What a hint shows for a key of the wrong type: its value in specs/ where one is typical.
_EXAMPLES = {"name": '"causal"', "dtype": '"bfloat16"', "expr": '"q_idx >= kv_idx"', "causal": "true"}


def _example(key: str, wanted: type | tuple[type, ...]) -> str:
    value = _EXAMPLES[key] if key in _EXAMPLES else {int: "128", str: '"..."', bool: "true"}[wanted]
    return f"e.g. {key} = {value}"


def _position(d: Diagnostic) -> tuple[int, int]:
    return (d.location.line, d.location.col) if d.location else (0, 0)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _param_name_problem(name: str) -> str | None:
    """Why `name` cannot be a param (the hint of the error), or None."""
    if not _IDENT_RE.fullmatch(name):
        return "use ASCII letters, digits and _, starting with a letter (at most 64 characters)"
    if keyword.iskeyword(name):
        return "this is a Python keyword"
    if name in RESERVED_NAMES:
        return f"`{name}` is a name of the expression language or of the generated functions"
    return None


_TENSOR_TYPE_RE = re.compile(r"(int|float)\[([^\]]*)\]", re.ASCII)
_DIM_RE = re.compile(r"[1-9][0-9]{0,9}|[A-Za-z][A-Za-z0-9_]{0,63}", re.ASCII)


def _param(name: str, declared: Any) -> tuple[Param | None, str | None]:
    """The Param a [params] entry declares, or why it declares none."""
    if not isinstance(declared, str):
        return None, f'the type must be a string such as "int", got {_described(declared)}'
    if declared in PARAM_TYPES:
        return Param(name, PARAM_TYPES[declared]), None
    m = _TENSOR_TYPE_RE.fullmatch(declared.replace(" ", ""))
    if not m:
        return None, f'the type must be "int", "float", "int[axes]" or "float[axes]", got {_described(declared)}'
    dims = m.group(2).split(",")
    if not 1 <= len(dims) <= MAX_TENSOR_RANK:
        return None, f"a tensor has 1 to {MAX_TENSOR_RANK} axes, got {len(dims)}"
    shape = []
    for dim in dims:
        if not _DIM_RE.fullmatch(dim) or keyword.iskeyword(dim):
            return None, f"axis {_described(dim)} is neither a positive int nor a size name"
        shape.append(int(dim) if dim.isdigit() else dim)
    if any(isinstance(d, int) and d > 2**31 - 1 for d in shape):
        return None, "an axis does not fit in int32"
    return Param(name, PARAM_TYPES[m.group(1)], tuple(shape)), None


def _load_toml(text: str, loc: _Locator) -> dict[str, Any]:
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
    loc = _Locator(path, text)
    try:
        sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    except UnicodeEncodeError as e:  # a lone surrogate: only reachable through a str, not a file
        raise SpecError([Diagnostic("the spec is not valid Unicode (a lone surrogate)", loc.at(e.start).location)])
    data = _load_toml(text, loc)
    loc.toml = _TomlPositions(text)
    v = _Validator(loc)

    top = v.typed(data, None)
    name = top.get("name")
    if name is None and "name" not in data:
        v.error("missing `name`", loc.start(), 'add e.g. name = "causal" (the package name under generated/)')
    elif name is not None and (not _NAME_RE.fullmatch(name) or keyword.iskeyword(name)):
        v.error(
            f"name {_described(name)} is not a valid package name",
            loc.value("name", end=len(name)),
            "use lowercase ASCII letters, digits and _; start with a letter (at most 64 characters)",
        )
    head_dim = top.get("head_dim")
    if head_dim is None and "head_dim" not in data:
        v.error("missing `head_dim`", loc.start(), "add e.g. head_dim = 128")
    for key, padded in (("head_dim", "q, k and v"), ("head_dim_v", "v")):
        size = top.get(key)
        if size is not None and not 16 <= size <= 256:
            v.error(f"{key} {_described(size)} is outside 16..256", loc.key(key), f"e.g. {key} = 128")
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
            f"dtype {_described(dtype)} is not supported",
            loc.value("dtype", end=len(dtype)),
            f"use one of {', '.join(DTYPES)}",
        )

    params = []
    raw_params = v.table(data, "params")
    for pname, ptype in raw_params.items():
        spot = loc.key("params", pname)
        if hint := _param_name_problem(pname):
            v.error(f"param name {_described(pname)} is not allowed", spot, hint)
            continue
        param, problem = _param(pname, ptype)
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
            f'causal must be true, false, "top_left" or "bottom_right", got {_described(causal)}',
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
    if mask_names is not None and score_names is not None:  # else which names are read is unknown
        for p in params:
            if p.name not in mask_names | score_names:
                v.error(
                    f"param `{p.name}` is declared but never used",
                    loc.key("params", p.name),
                    "read it in the [mask] or [score] expr, or remove it",
                )

    tri = v.typed(v.table(data, "triton"), "triton")
    kernels = ("", "short_", "dq_", "dkdv_")  # the [triton] key prefix of each kernel's tiles
    for key in (f"{kernel}{block}" for kernel in kernels for block in ("block_m", "block_n")):
        if key in tri and not (_power_of_two(tri[key]) and 16 <= tri[key] <= 256):
            v.error(
                f"triton {key} must be a power of two in 16..256, got {_described(tri[key])}", loc.key("triton", key)
            )
    for key in (f"{kernel}num_warps" for kernel in kernels):
        if key in tri and tri[key] not in (1, 2, 4, 8, 16):
            v.error(f"triton {key} must be 1, 2, 4, 8 or 16, got {_described(tri[key])}", loc.key("triton", key))
    for key in (f"{kernel}num_stages" for kernel in kernels):
        if key in tri and not 1 <= tri[key] <= 8:
            v.error(f"triton {key} must be in 1..8, got {_described(tri[key])}", loc.key("triton", key))
    if "short_kv_len" in tri and not 0 <= tri["short_kv_len"] < 2**31:
        v.error(
            f"triton short_kv_len must be in 0..2**31-1, got {_described(tri['short_kv_len'])}",
            loc.key("triton", "short_kv_len"),
            "0 turns the short-sequence forward off",
        )

    tpu = v.typed(v.table(data, "pallas_tpu"), "pallas_tpu")
    # TPU tiles are (8 sublanes, 128 lanes): q rows are a sublane dim, kv a lane dim of the scores.
    if "block_q" in tpu and not (tpu["block_q"] % 8 == 0 and 8 <= tpu["block_q"] <= 4096):
        v.error(
            f"pallas_tpu block_q must be a multiple of 8 in 8..4096, got {_described(tpu['block_q'])}",
            loc.key("pallas_tpu", "block_q"),
            "TPU blocks are tiled by (8, 128)",
        )
    if "block_kv" in tpu and not (tpu["block_kv"] % 128 == 0 and 128 <= tpu["block_kv"] <= 4096):
        v.error(
            f"pallas_tpu block_kv must be a multiple of 128 in 128..4096, got {_described(tpu['block_kv'])}",
            loc.key("pallas_tpu", "block_kv"),
            "TPU blocks are tiled by (8, 128)",
        )

    if "vmem_limit_bytes" in tpu and not 1 << 20 <= tpu["vmem_limit_bytes"] <= 128 << 20:
        v.error(
            "pallas_tpu vmem_limit_bytes must be in 1 MiB..128 MiB",
            loc.key("pallas_tpu", "vmem_limit_bytes"),
            "e.g. vmem_limit_bytes = 33554432 (32 MiB)",
        )
    elif head_dim is not None and dtype in DTYPES and not v.problems:
        config = PallasTpuConfig(**tpu)
        limit = config.vmem_limit_bytes or DEFAULT_VMEM_LIMIT
        itemsize = 4 if dtype == "float32" else 2
        widest = max(head_dim, top.get("head_dim_v") or head_dim)
        for kernel, need in vmem_estimate(config.block_q, config.block_kv, widest, itemsize).items():
            if need > limit:
                v.error(
                    f"the Pallas {kernel} kernel needs about {need / 2**20:.1f} MiB of VMEM with block_q={config.block_q},"
                    f" block_kv={config.block_kv}; the scoped limit is {limit / 2**20:.0f} MiB",
                    loc.key("pallas_tpu"),
                    "use a smaller block_kv or block_q, or raise vmem_limit_bytes",
                )
                break

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
        triton=triton_config(max(head_dim, top.get("head_dim_v") or 0), dtype, tri),
        triton_pinned=tuple(sorted(tri)),
        pallas_tpu=PallasTpuConfig(**tpu),
        path=path,
        sha256=sha256,
        mask_source=mask_source,
        score_source=score_source,
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
        spot = _Locator(str(path), text).at(bad)
        raise SpecError(
            [Diagnostic(f"the spec is not UTF-8: byte 0x{data[e.start]:02x}", spot.location, "save it as UTF-8")]
        ) from None
    return parse_spec(text.removeprefix("\ufeff"), str(path))
