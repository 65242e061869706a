"""Spec validation: every problem reported at once, each at file:line:col with a caret."""

from pathlib import Path

import pytest

from attngen.errors import SpecError
from attngen.spec import CAUSAL_MASK, PallasTpuConfig, TritonConfig, load_spec, parse_spec

GOOD = 'name = "ok"\nhead_dim = 64\n'


def problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_spec(text, "s.toml")
    return [d.render() for d in e.value.diagnostics]


def test_defaults_and_causal_shorthand():
    spec = parse_spec(GOOD + "[mask]\ncausal = true\n", "s.toml")
    assert spec.dtype == "bfloat16" and spec.mask_source == CAUSAL_MASK
    assert spec.triton == TritonConfig() and spec.pallas_tpu == PallasTpuConfig()
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
        'must be "int" or "float"' in p for p in problems(GOOD + '[mask]\nexpr = "q_idx > w"\n[params]\nw = "long"\n')
    )


def test_specs_folder_is_valid():
    for path in sorted(Path(__file__).resolve().parent.parent.joinpath("specs").glob("*.toml")):
        spec = load_spec(path)
        assert spec.name == path.stem
