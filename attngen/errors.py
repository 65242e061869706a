"""The one error family of attngen.

Every problem a user can cause (a malformed spec, an expression that does not type-check, a
build that would overwrite a file attngen did not write) is an AttngenError. Spec problems are
collected as Diagnostics, each pointing at file:line:col, and raised together once.

Error text quotes what the user wrote, and what the user wrote may hold anything: control
characters that would drive a terminal, lone surrogates that cannot be printed, megabyte-long
lines. `shown` and Diagnostic.render make every quoted piece safe and short.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# A source line longer than this is shown as a window around the caret.
_SHOWN_LINE = 100
_REPLACEMENT = "\N{REPLACEMENT CHARACTER}"


def shown(text: str, limit: int | None = 60) -> str:
    """`text` as it may appear inside a message: non-printable characters escaped, at most
    `limit` characters (then an ellipsis; None: no limit)."""
    safe = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)
    return safe if limit is None or len(safe) <= limit else safe[: limit - 1] + "…"


def shown_path(path: str | os.PathLike) -> str:
    """A file path as it may be printed: bytes that are not UTF-8 (undecodable file names come in
    as surrogate escapes) and control characters escaped."""
    text = os.fspath(path)
    try:
        text = os.fsencode(text).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name produces: `shown` escapes it
        pass
    return shown(text, limit=None)


def _printable_line(line: str) -> str:
    """The line with each character a terminal would not print as itself replaced, one for one,
    so a caret under it stays aligned."""
    return "".join(c if c == "\t" or c.isprintable() else _REPLACEMENT for c in line)


@dataclass(frozen=True)
class Location:
    """A position in a source file; line and col are 1-based."""

    path: str
    line: int
    col: int
    source_line: str = ""


@dataclass(frozen=True)
class Diagnostic:
    """One problem in a spec, with where it is and, optionally, how to fix it."""

    message: str
    location: Location | None = None
    hint: str | None = None
    width: int = 1

    def render(self) -> str:
        if self.location is None:
            text = f"error: {self.message}"
        else:
            loc = self.location
            text = f"{shown_path(loc.path)}:{loc.line}:{loc.col}: error: {self.message}"
            if loc.source_line:
                line, caret = _excerpt(_printable_line(loc.source_line), loc.col - 1, max(1, self.width))
                text += f"\n    {line}\n    {caret}"
        if self.hint:
            text += f"\n    hint: {self.hint}"
        return text


def _excerpt(line: str, start: int, width: int) -> tuple[str, str]:
    """(shown line, caret line) underlining line[start:start + width]; a long line is cut to a
    window around the caret."""
    start = min(max(start, 0), len(line))
    width = max(1, min(width, len(line) - start, _SHOWN_LINE // 2))
    cut = 0
    if len(line) > _SHOWN_LINE:
        cut = min(max(0, start - _SHOWN_LINE // 4), len(line) - _SHOWN_LINE)
        line = ("…" if cut else "") + line[cut : cut + _SHOWN_LINE] + ("…" if cut + _SHOWN_LINE < len(line) else "")
        start = start - cut + (1 if cut else 0)
    # A tab before the caret moves it as far as the tab moves the text above it.
    pad = "".join("\t" if c == "\t" else " " for c in line[:start])
    return line, pad + "^" * width


class AttngenError(Exception):
    """Base of every error attngen raises on purpose."""


class SpecError(AttngenError):
    """A spec has one or more problems; `diagnostics` lists every one of them."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = tuple(diagnostics)
        super().__init__("\n".join(d.render() for d in self.diagnostics))


class BuildError(AttngenError):
    """Writing the generated package failed, would lose a file, or would write where it may not."""
