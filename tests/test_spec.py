"""Spec validation: every problem reported at once, each at file:line:col with a caret; any
malformed input is a SpecError, never another exception."""

import os
from pathlib import Path

import pytest

from attngen.backends.pallas_tpu import PallasTpuConfig
from attngen.backends.triton_gpu import default_config
from attngen.errors import SpecError
from attngen.spec import CAUSAL_MASK, MAX_SPEC_BYTES, load_spec, parse_spec, retarget

GOOD = 'name = "ok"\nhead_dim = 64\n'


def problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_spec(text, "s.toml")
    return [d.render() for d in e.value.diagnostics]


def test_defaults_and_causal_shorthand():
    spec = parse_spec(GOOD + "[mask]\ncausal = true\n", "s.toml")
    assert spec.dtype == "bfloat16" and spec.mask_source == CAUSAL_MASK
    assert spec.config("pallas_tpu") == PallasTpuConfig()  # (unset [triton] keys come from the tuned table)
    assert spec.score is None and spec.params == ()
    assert parse_spec(GOOD, "s.toml").mask is None


def test_every_problem_is_reported_with_location():
    text = "\n".join(
        [
            'name = "Bad Name"',
            'head_dim = "128"',
            'dtype = "float8"',
            "colour = 3",
            "[mask]",
            'expr = "q_idx >= kv_idx and windw"',
            "[score]",
            'expr = "q_idx + 1"',
            "[params]",
            'window = "int"',
            "[triton]",
            "block_m = 100",
            "num_warps = 3",
            "[pallas_tpu]",
            "block_q = 12",
            "block_kv = 100",
        ]
    )
    found = problems(text)
    expected = [
        ("s.toml:1:9:", "not a valid package name"),
        ("s.toml:2:1:", "`head_dim` must be an integer"),
        ("s.toml:3:10:", "dtype 'float8' is not supported"),
        ("s.toml:4:1:", "unknown key `colour`"),
        ("s.toml:6:29:", "unknown name `windw`"),
        ("s.toml:8:9:", "a score expression must be float"),
        ("s.toml:10:1:", "declared but never used"),
        ("s.toml:12:1:", "block_m must be a power of two"),
        ("s.toml:13:1:", "num_warps must be"),
        ("s.toml:15:1:", "block_q must be a multiple of 8"),
        ("s.toml:16:1:", "block_kv must be a multiple of 128"),
    ]
    assert len(found) == len(expected)
    for rendered, (where, what) in zip(found, expected):
        assert rendered.startswith(where) and what in rendered, rendered
    windw = next(r for r in found if "windw" in r)
    assert windw.splitlines()[2].index("^") == windw.splitlines()[1].index("windw")


def test_short_forward_tiles():
    """Unpinned specs take the tuned table's short-sequence forward; forward tiles pinned without
    short_* keys hold at every length (also after retargeting); a negative length is an error."""
    table = default_config(64, "bfloat16")
    assert parse_spec(GOOD, "s.toml").config("triton_gpu").short_kv_len == table["short_kv_len"] > 0
    pinned = parse_spec(GOOD + "[triton]\nblock_m = 64\n", "s.toml")
    assert pinned.config("triton_gpu").short_kv_len == 0
    assert retarget(pinned, 64, "float16").config("triton_gpu").short_kv_len == 0
    both = parse_spec(GOOD + "[triton]\nnum_warps = 4\nshort_kv_len = 512\nshort_block_m = 32\n", "s.toml")
    config = both.config("triton_gpu")
    assert (config.short_kv_len, config.short_block_m, config.num_warps) == (512, 32, 4)
    (rendered,) = problems(GOOD + "[triton]\nshort_kv_len = -1\n")
    assert rendered.startswith("s.toml:4:1:") and "short_kv_len must be in 0..2**31-1" in rendered


def test_toml_syntax_error_has_location():
    (rendered,) = problems('name = "x"\nhead_dim = = 3\n')
    assert rendered.startswith("s.toml:2:") and "invalid TOML" in rendered


def test_expression_syntax_error_points_inside_the_string():
    (rendered,) = problems(GOOD + '[mask]\nexpr = "q_idx >= "\n')
    assert rendered.startswith("s.toml:4:18:") and "unexpected end" in rendered


@pytest.mark.parametrize("name", ["import", "q_idx", "score", "__import__", "scale", "x-y"])
def test_bad_param_names(name):
    (rendered,) = problems(GOOD + f'[mask]\nexpr = "q_idx >= 0"\n[params]\n"{name}" = "int"\n')
    assert "not allowed" in rendered


def test_conflicts_and_missing_keys():
    assert any("both `causal` and `expr`" in p for p in problems(GOOD + '[mask]\ncausal = true\nexpr = "q_idx > 0"\n'))
    assert any("missing `name`" in p for p in problems("head_dim = 64\n"))
    assert any("must be a table" in p for p in problems(GOOD + "mask = 3\n"))
    assert any(
        'must be "int", "float", "int[axes]", "float[axes]" or "bool[axes]"' in p
        for p in problems(GOOD + '[mask]\nexpr = "q_idx > w"\n[params]\nw = "long"\n')
    )


def test_specs_folder_is_valid():
    for path in sorted(Path(__file__).resolve().parent.parent.joinpath("specs").glob("*.toml")):
        spec = load_spec(path)
        assert spec.name == path.stem


# ----------------------------------------------------------------------------- malformed input


def diagnostics(text: str) -> list:
    with pytest.raises(SpecError) as e:
        parse_spec(text, "s.toml")
    assert e.value.diagnostics and all(d.location is not None for d in e.value.diagnostics)
    return list(e.value.diagnostics)


def where(d) -> tuple[int, int]:
    return d.location.line, d.location.col


def load_problem(path) -> str:
    with pytest.raises(SpecError) as e:
        load_spec(path)
    (d,) = e.value.diagnostics
    return d.render()


def test_unreadable_spec_files(tmp_path):
    assert "cannot read spec: it is a folder" in load_problem(tmp_path)
    assert "No such file or directory" in load_problem(tmp_path / "missing.toml")
    assert "embedded null byte" in load_problem(tmp_path / "nul\0.toml")
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    assert "not a regular file" in load_problem(fifo)  # and the read does not block
    big = tmp_path / "big.toml"
    big.write_bytes(GOOD.encode() + b"#" * MAX_SPEC_BYTES)
    assert "larger than 1 MiB" in load_problem(big)


def test_bytes_that_are_not_utf8_are_located(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(GOOD.encode() + "# café\n".encode("latin-1"))
    rendered = load_problem(path)
    assert (
        rendered.startswith(f"{path}:3:6: error: the spec is not UTF-8: byte 0xe9")
        and "hint: save it as UTF-8" in rendered
    )


def test_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert load_spec(path).name == "ok"


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "missing `name`"),
        ('name = "x"\nhead_dim = ' + "[" * 2000 + "]" * 2000 + "\n", "nested too deeply"),
        ('name = "x"\nhead_dim = ' + "9" * 5000 + "\n", "Exceeds the limit"),
        ('name = "x"\nhead_dim = 64\n[mask]\nexpr = "q_idx >= kv_idx\n', "invalid TOML"),
        ('name = "x"\nhead_dim = 64\nname = "y"\n', "invalid TOML"),
        ('name = "x"\nhead_dim = 64\n[mask]\nexpr = "\ud800"\n', "not valid Unicode"),
    ],
)
def test_malformed_toml_is_a_located_error(text, message):
    assert message in diagnostics(text)[0].message


BAD_VALUES = {
    "an array": "[1, 2]",
    "a table": "{ a = 1 }",
    "a date/time": "1979-05-27T07:32:00Z",
    "nan": "nan",
    "inf": "-inf",
    "huge int": "99999999999999999999999999",
    "bool": "true",
    "float": "64.0",
    "string": '"64"',
}


@pytest.mark.parametrize("value", BAD_VALUES.values(), ids=BAD_VALUES.keys())
@pytest.mark.parametrize(
    "table, key", [(None, "head_dim"), (None, "name"), ("mask", "causal"), ("score", "expr"), ("triton", "block_m")]
)
def test_wrong_types_everywhere_are_located(table, key, value):
    """A value of any TOML type at any key: one error, on the key's line, no exception."""
    lines = ['name = "ok"', "head_dim = 64"]
    lines = [line for line in lines if not (table is None and line.startswith(key))]
    lines = (
        ([f"{key} = {value}"] if table is None else []) + lines + ([f"[{table}]", f"{key} = {value}"] if table else [])
    )
    text = "\n".join(lines) + "\n"
    try:
        spec = parse_spec(text, "s.toml")
    except SpecError as e:
        line = text.splitlines().index(f"{key} = {value}") + 1
        assert [d.location.line for d in e.diagnostics] == [line], e
    else:  # some values have the right type somewhere (a string for a name, true for causal)
        assert spec is not None


@pytest.mark.parametrize(
    "text, line, col, message",
    [
        # Tables in every TOML form: [[array of tables]], [dotted.header], inline tables, dotted keys.
        (GOOD + "[[mask]]\nexpr = 'q_idx > 0'\n", 3, 1, "`mask` must be a table ([mask]), got an array"),
        (GOOD + "[mask.expr]\nx = 1\n", 3, 1, "`expr` must be a string, got a table"),
        (GOOD + "[params.w]\nx = 1\n", 3, 1, 'param `w`: the type must be a string such as "int", got a table'),
        (GOOD + "triton = { block_m = 32, colour = 1 }\n", 3, 26, "unknown key `colour` in [triton]"),
        (GOOD + "triton.colour = 1\n", 3, 1, "unknown key `colour` in [triton]"),
        (GOOD + '"quoted key" = 1\n', 3, 1, "unknown key `quoted key`"),
        (GOOD + "mask = { expr = 'q_idx > nope' }\n", 3, 26, "unknown name `nope`"),
        # Columns inside strings count source characters: escapes are wider than what they mean.
        (GOOD + '[mask]\nexpr = "q_idx >= \\u006bv_idx and nope"\n', 4, 34, "unknown name `nope`"),
        # A multi-line string: the line and column of the character inside it (past a line end).
        (GOOD + '[mask]\nexpr = """\nq_idx >= kv_idx and\n  nope > 1"""\n', 6, 3, "unknown name `nope`"),
        # Line numbers count "\n" only, as TOML does, whatever else Unicode calls a line break.
        (GOOD + "# a\u2028comment\x85with breaks\n[mask]\nexpr = 'nope > 1'\n", 5, 9, "unknown name `nope`"),
        ('name = "x"\r\nhead_dim = 64\r\n[mask]\r\nexpr = "nope > 1"\r\n', 4, 9, "unknown name `nope`"),
    ],
)
def test_locations_in_every_toml_form(text, line, col, message):
    (d,) = diagnostics(text)
    assert message in d.message and where(d) == (line, col), d.render()


@pytest.mark.parametrize(
    "name", ["causal\n", "caus\u0430l", "a" * 65, "", "__init__", "import", "sp ace", "../up", "a.b", "A"]
)
def test_package_names_are_strict(name):
    """fullmatch, ASCII: a trailing newline or a Cyrillic look-alike does not slip through."""
    escaped = name.replace("\n", "\\n")
    (d,) = diagnostics(f'name = "{escaped}"\nhead_dim = 64\n')
    assert "is not a valid package name" in d.message


@pytest.mark.parametrize(
    "name, hint",
    [
        ("w\\n", "ASCII letters"),
        ("wіndow", "ASCII letters"),  # Cyrillic і
        ("_w", "ASCII letters"),
        ("__class__", "ASCII letters"),
        ("a" * 65, "ASCII letters"),
        ("lambda", "keyword"),
        ("where", "name of the expression language"),
    ],
)
def test_param_names_are_strict(name, hint):
    (d,) = diagnostics(GOOD + f'[mask]\nexpr = "q_idx >= 0"\n[params]\n"{name}" = "int"\n')
    assert "is not allowed" in d.message and hint in d.hint


def test_messages_escape_what_a_terminal_would_run():
    """An escape sequence in a key reaches the message escaped, never raw."""
    (d,) = diagnostics(GOOD + '"\\u001b[2J" = 1\n')
    rendered = d.render()
    assert "\x1b" not in rendered and "\\x1b[2J" in rendered


def test_long_lines_are_shown_around_the_caret():
    long_mask = " or ".join(["q_idx >= kv_idx"] * 60) + " or nope > 1"
    (d,) = diagnostics(GOOD + f'[mask]\nexpr = "{long_mask}"\n')
    _, shown_line, caret = d.render().splitlines()[:3]
    assert len(shown_line) < 120 and shown_line[caret.index("^") :].startswith("nope")


def test_unused_params_are_not_guessed_when_an_expression_does_not_parse():
    (d,) = diagnostics(GOOD + '[mask]\nexpr = "q_idx >= w +"\n[params]\nw = "int"\n')
    assert "unexpected end" in d.message


def test_head_dim_must_be_a_multiple_of_8():
    (rendered,) = problems('name = "x"\nhead_dim = 20\n')
    assert "s.toml:2:1:" in rendered and "not a multiple of 8" in rendered and "head_dim = 24" in rendered


def test_causal_alignment():
    bottom_right = parse_spec(GOOD + '[mask]\ncausal = "bottom_right"\n', "s.toml")
    assert bottom_right.mask_source == "q_idx + kv_len - q_len >= kv_idx"
    assert parse_spec(GOOD + '[mask]\ncausal = "top_left"\n', "s.toml").mask_source == CAUSAL_MASK
    assert parse_spec(GOOD + "[mask]\ncausal = false\n", "s.toml").mask is None
    (shown,) = problems(GOOD + '[mask]\ncausal = "diagonal"\n')
    assert 'causal must be true, false, "top_left" or "bottom_right"' in shown and "s.toml:4:1" in shown


def test_value_head_dim():
    spec = parse_spec(GOOD + "head_dim_v = 32\n", "s.toml")
    assert (spec.head_dim, spec.value_dim) == (64, 32) and parse_spec(GOOD, "s.toml").value_dim == 64
    (shown,) = problems(GOOD + "head_dim_v = 100\n")
    assert "head_dim_v 100 is not a multiple of 8" in shown and "head_dim_v = 104" in shown
    assert "head_dim_v 512 is outside 16..256" in problems(GOOD + "head_dim_v = 512\n")[0]


@pytest.mark.parametrize(
    "text, line, close",
    [
        ('name = "ok"\nhaed_dim = 64\n', 2, "`head_dim`"),
        (GOOD + "head_dims_v = 64\n", 3, "`head_dim_v`"),
        (GOOD + "[triton]\nblock-m = 64\n", 4, "`block_m`"),
        (GOOD + "[mask]\nexp = 'q_idx >= kv_idx'\n", 4, "`expr`"),
        (GOOD + "[maks]\ncausal = true\n", 3, "`[mask]`"),
    ],
)
def test_a_misspelt_key_gets_did_you_mean(text, line, close):
    found = [d for d in diagnostics(text) if "unknown key" in d.message]
    assert len(found) == 1 and found[0].location.line == line, [d.render() for d in found]
    assert found[0].hint.startswith(f"did you mean {close}?"), found[0].hint


def test_an_unlike_key_gets_no_guess():
    (d,) = diagnostics(GOOD + "colour = 1\n")
    assert "did you mean" not in d.hint and d.hint.startswith("allowed: ")
