"""Hostile specs: names, params and expressions that try to escape into generated source.

Two halves. Everything that tries (quotes, newlines, dunder names, attribute access, lambda,
calls, look-alike letters, very long or deeply nested text) is rejected before anything is
written. And what is accepted cannot add to the source: every NAME token of every generated
module is in a whitelist built from the templates' own text, the printers' vocabulary and the
spec's validated names (params as the kernels prefix them), and every string literal holds only
those words.
"""

import io
import re
import string
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from attngen import ir
from attngen.analysis.tiles import TILE_VARS
from attngen.backends import TARGETS
from attngen.backends.triton_gpu import TILE_KEYS
from attngen.build import PACKAGE_INIT, TEMPLATES, package_sources, spec_label
from attngen.cli import main
from attngen.errors import SpecError
from attngen.plan import make_plan
from attngen.spec import DTYPES, Spec, load_spec, parse_spec
from tests.strategies import exact_specs, specs, typed_expressions

ROOT = Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("*.toml"))
GOOD = 'name = "ok"\nhead_dim = 64\n'

# An identifier, or a number (so that the exponent of 1e-05 is not read as a name `e`).
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|\d[\d.]*(?:[eE][+-]?\d+)?")


def _identifiers(text: str) -> set[str]:
    return {w for w in _WORD.findall(text) if not w[0].isdigit()}


# The templates: the Jinja files and the one-line-format package __init__.py of attngen.build.
TEMPLATE_TEXT = "".join(p.read_text() for p in sorted(TEMPLATES.rglob("*.jinja"))) + PACKAGE_INIT


def printer_spellings() -> str:
    """What the targets' expression printers add to template text: their spelling of functions,
    operations and conversions, read off the backends (a new spelling needs no edit here)."""
    spellings = []
    for backend in TARGETS:
        d = backend.dialect
        spellings += [*d.functions.values(), d.where, d.floordiv or "", d.floormod or "", *d.logic]
        spellings += [d.logical_not("operand"), d.to_float("operand")]
    return " ".join(spellings)


def target_vocabulary() -> set[str]:
    """Every name the targets add to template text: their module names, the printers' spellings,
    the variables the templates bind for the expressions to read, and the constants named after
    each kernel's tiles (DQ_BLOCK_M: its prefix and key, upper-cased; the prefix as a key)."""
    words = {backend.name for backend in TARGETS} | (_identifiers(printer_spellings()) - {"operand"})
    tiles = {f"{k.tiles}{key}".upper() for b in TARGETS for k in b.kernels if k.tiles for key in TILE_KEYS}
    prefixes = {k.tiles for b in TARGETS for k in b.kernels if k.tiles}
    return words | set(ir.INDEX_VARS) | {"score"} | set(TILE_VARS) | tiles | prefixes


# Names that need no spec: whatever the templates spell (their Python keywords, builtins, the
# torch/triton/jax modules and attributes they use, and the names they define; Jinja's own words
# come along, harmlessly) and what the targets add. The spec language's words appear only inside
# docstrings (the expressions re-printed from IR).
SPEC_FREE_NAMES = frozenset(_identifiers(TEMPLATE_TEXT) | target_vocabulary())
SPEC_LANGUAGE_WORDS = frozenset({*ir.INDEX_VARS, "score", "where", *ir.FUNCTIONS, "and", "or", "not", "none"})


@dataclass(frozen=True)
class Whitelist:
    """What generated source for one spec may hold: names as NAME tokens, words in strings."""

    names: frozenset[str]
    words: frozenset[str]


TORCH_OPS = ("fwd", "bwd", "fp8", "kvcache", "kvcache_append", "packing")  # a Triton module's custom ops, by suffix


def whitelist(spec: Spec) -> Whitelist:
    """The spec-free names plus what the spec adds: params as the kernels prefix them (and a
    tensor's sizes and loader), its dtype (torch.<dtype>), the custom-op names derived from its
    name and the names numbered after its trained reads as names; its validated name, params and axis names, as written, as words in strings too."""
    prefixed = {f"{backend.param_prefix}{p.name}" for backend in TARGETS for p in spec.params}
    for backend in TARGETS:  # a tensor param's kernel arguments, and its load helper where the target has one
        for p in spec.params:
            if p.is_tensor:
                name = f"{backend.param_prefix}{p.name}"
                prefixed |= {*backend.tensor_args(name, len(p.shape)), f"load_{name}"}
    axes = {axis for p in spec.params for axis in p.shape if isinstance(axis, str)}
    op_names, trained = set(), set()
    for backend in TARGETS:
        plan = make_plan(spec, backend, spec_label(spec))
        op_names |= {plan.op_name, *(f"{plan.op_name}_{op}" for op in TORCH_OPS)}
        for g in plan.param_grads:  # a trained read's derivative helper, kernel arguments and sums
            trained |= {
                *g.kernel_args,
                *(f"{stem}{g.slot}" for stem in ("_param_grad", "grad", "share")),
                f"share{g.slot}_ref",
            }
    names = SPEC_FREE_NAMES | prefixed | op_names | trained | {spec.dtype}
    return Whitelist(names, names | SPEC_LANGUAGE_WORDS | {spec.name, *(p.name for p in spec.params)} | axes)


def foreign_names(source: str, allowed: Whitelist) -> set[str]:
    """Names in source outside the whitelist: NAME tokens, and words inside string literals."""
    foreign = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and token.string not in allowed.names:
            foreign.add(token.string)
        elif token.type == tokenize.STRING:
            foreign |= _identifiers(token.string) - allowed.words
    return foreign


def assert_source_is_whitelisted(spec: Spec) -> None:
    allowed = whitelist(spec)
    for filename, source in package_sources(spec).items():
        assert not foreign_names(source, allowed), f"{filename}: {foreign_names(source, allowed)}"
        # Nor a character the templates and printers do not have (control characters, look-alikes)
        # outside comments; the one comment with user text, the spec file's name, is escaped.
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        code = "".join(t.string for t in tokens if t.type != tokenize.COMMENT)
        trusted = set(TEMPLATE_TEXT + printer_spellings() + string.ascii_letters + string.digits + "_")
        assert set(code) <= trusted, filename


def test_whitelist_catches_a_name_the_templates_do_not_have():
    """The check has teeth: a name a spec could not add is reported, in code and in strings."""
    spec = load_spec(ROOT / "specs" / "causal.toml")
    source, allowed = package_sources(spec)["triton_gpu.py"], whitelist(spec)
    assert foreign_names(source + "\nimport os\n", allowed) == {"os"}
    assert foreign_names(source + '\nX = "__import__"\n', allowed) == {"X", "__import__"}
    assert not foreign_names(source, allowed)


@pytest.mark.parametrize("spec_file", SPECS, ids=lambda p: p.stem)
def test_examples_use_only_whitelisted_names(spec_file, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert_source_is_whitelisted(load_spec(spec_file.relative_to(ROOT)))


# Valid param names of any shape (the validator's own pattern), each used by the expressions.
_PARAM_NAMES = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,20}", fullmatch=True).filter(
    lambda n: n not in {"and", "or", "not", "if", "else", "for", "in", "is", "lambda", "None", "True", "False"}
)


@st.composite
def specs_with_drawn_params(draw) -> str:
    names = draw(st.lists(_PARAM_NAMES, min_size=1, max_size=3, unique=True))
    mask = " and ".join(f"q_idx - kv_idx < {n}" for n in names)
    declared = "".join(f'{n} = "int"\n' for n in names)
    return GOOD + f'[mask]\nexpr = "{mask}"\n[params]\n' + declared


@settings(max_examples=12)
@given(
    text=st.one_of(
        specs().map(lambda s: s.text),
        exact_specs().map(lambda s: s.text),
        specs_with_drawn_params(),
        typed_expressions("float", allow_score=True).map(lambda s: GOOD + f'[score]\nexpr = "{s}"\n'),
    )
)
@example(text=GOOD + '[mask]\nexpr = "not (kv_idx == q_idx - 38)"\n')  # `not` prints as Triton's `~`
def test_drawn_specs_use_only_whitelisted_names(text):
    try:
        spec = parse_spec(text, "drawn.toml")
    except SpecError:
        return  # rejected: nothing is generated (reserved or keyword names, bad constants)
    assert_source_is_whitelisted(spec)


def test_a_hostile_file_name_stays_in_its_comment(tmp_path, monkeypatch):
    """The spec file's name is the one piece of user text in generated source (a comment that
    names the spec): a newline in it would end the comment and start code."""
    monkeypatch.chdir(tmp_path)
    name = 'x\nimport os\nos.system("echo pwned")\n\u202e\x1b.toml'
    (tmp_path / name).write_text((ROOT / "specs" / "causal.toml").read_text())
    spec = load_spec(name)
    for source in package_sources(spec).values():
        header = source.splitlines()[:2]
        assert header[1].startswith("# spec: causal (x\\nimport os\\nos.system(") and "\\u202e\\x1b" in header[1]
    assert_source_is_whitelisted(spec)


# ----------------------------------------------------------------------------- rejected before writing

HOSTILE_NAMES = [
    'x"; import os; "',
    "x\nimport os",
    "causal\n",
    "__import__",
    "os.path",
    "../escape",
    "caus\u0430l",  # Cyrillic а
    "causal\u202e",  # right-to-left override
    "causal\u200b",  # zero-width space
    "a" * 200,
    "",
]
HOSTILE_PARAMS = [
    "w\nimport os",
    'w": 1, "x',
    "w); import os; (",
    "__class__",
    "_w",
    "w.real",
    "wіndow",  # Cyrillic і
    "w\u200d",  # zero-width joiner
    "ｗ",  # fullwidth
    "lambda",
    "None",
    "scale",
    "q",
    "a" * 100,
]
HOSTILE_EXPRESSIONS = [
    "__import__('os').system('echo pwned') > 0",
    "q_idx.__class__ > 0",
    "q_idx.real > 0",
    "(lambda: 1)() > 0",
    "q_idx if b else h",
    "eval('1') > 0",
    "exec('import os') > 0",
    "open('/etc/passwd') > 0",
    "q_idx > 0; import os",
    "q_idx > 0\nimport os",
    "q_idx > 0 # comment",
    "q_idx > 0 \\\n or b > 0",
    "'q_idx' > 0",
    "q_idx[0] > 0",
    "[q_idx for q_idx in b] > 0",
    "q_idx ** 2 > 0",
    "q_idx @ kv_idx > 0",
    "(q_idx := 1) > 0",
    "{q_idx} > 0",
    "tl.exp(q_idx) > 0",
    "jnp.exp(q_idx) > 0",
    "torch > 0",
    "param_w > 0",
    "q_іdx > 0",  # Cyrillic і
    "q_idx > １",  # fullwidth digit
    "q\u200d_idx > 0",
    "q_idx >= kv_idx \u202e",
    "not " * 100 + "q_idx > 0",
    "-" * 100 + "q_idx > 0",
    "(" * 5000 + "q_idx" + ")" * 5000 + " > 0",
    "q_idx" + " + 1" * 5000 + " > 0",
    "q_idx > " + "9" * 5000,
    "score > 1e999",
]


def _toml_string(text: str) -> str:
    """text as a TOML basic string (every character that needs it escaped)."""
    escaped = "".join(c if c.isprintable() and c not in '"\\' else f"\\u{ord(c):04x}" for c in text)
    return f'"{escaped}"'


def _assert_rejected_and_nothing_written(text: str, tmp_path: Path) -> None:
    path = tmp_path / "hostile.toml"
    path.write_text(text)
    with pytest.raises(SpecError):
        load_spec(path)
    out = tmp_path / "out"
    assert main(["build", str(path), "--out", str(out), "--allow-outside"]) == 2
    assert not out.exists()


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_names_are_rejected(name, tmp_path):
    _assert_rejected_and_nothing_written(f"name = {_toml_string(name)}\nhead_dim = 64\n", tmp_path)


@pytest.mark.parametrize("param", HOSTILE_PARAMS)
def test_hostile_params_are_rejected(param, tmp_path):
    key = _toml_string(param)
    mask = _toml_string(f"q_idx - kv_idx < {param}")
    _assert_rejected_and_nothing_written(GOOD + f"[mask]\nexpr = {mask}\n[params]\n{key} = 'int'\n", tmp_path)


@pytest.mark.parametrize("expression", HOSTILE_EXPRESSIONS, ids=lambda e: repr(e[:40]))
@pytest.mark.parametrize("table", ["mask", "score"])
def test_hostile_expressions_are_rejected(expression, table, tmp_path):
    text = GOOD + f"[{table}]\nexpr = {_toml_string(expression)}\n[params]\nw = 'int'\n"
    _assert_rejected_and_nothing_written(text, tmp_path)


def test_dtype_is_one_of_a_fixed_set():
    """The dtype reaches code (torch.<dtype>, jnp.<dtype>): only the listed names pass."""
    for dtype in ("float32; import os", "float32\n", "bfloat16 ", "int8", "__class__"):
        with pytest.raises(SpecError, match="is not supported"):
            parse_spec(GOOD + f"dtype = {_toml_string(dtype)}\n", "s.toml")
    assert all(parse_spec(GOOD + f'dtype = "{d}"\n', "s.toml").dtype == d for d in DTYPES)
