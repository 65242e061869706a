"""attngen --version and attngen list."""

from pathlib import Path

import pytest

import attngen
from attngen.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"attngen {attngen.__version__}"
    assert attngen.__version__[0].isdigit()  # the installed distribution's, not "unknown"


def test_list_shows_one_line_per_spec(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["list"]) == 0  # specs/ by default
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(list((ROOT / "specs").glob("*.toml")))
    by_name = {line.split(":", 1)[0]: line for line in lines}
    assert by_name["sliding_window"] == (
        "sliding_window: mask (q_idx >= kv_idx) and (q_idx - kv_idx < window); score none; params window: int;"
        " bfloat16; head_dim 128"
    )
    assert "params slopes: float[heads]" in by_name["alibi_slopes"]
    assert "score softcap * tanh(score / softcap)" in by_name["softcap"]
    assert by_name["value_dim"].endswith("head_dim 192 (v: 128)")


def test_list_reports_a_bad_spec_and_lists_the_others(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text('name = "bad"\n')
    (tmp_path / "good.toml").write_text('name = "good"\nhead_dim = 64\n')
    assert main(["list", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("good: mask none; score none; params none;") and "missing `head_dim`" in err
