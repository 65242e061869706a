"""The one error family of attngen.

Every problem a user can cause (a malformed spec, an expression that does not type-check, a
build that would overwrite a file attngen did not write) is an AttngenError. Spec problems are
collected as Diagnostics, each pointing at file:line:col, and raised together once.
"""

from __future__ import annotations

from dataclasses import dataclass


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
            text = f"{loc.path}:{loc.line}:{loc.col}: error: {self.message}"
            if loc.source_line:
                caret = " " * (loc.col - 1) + "^" * max(1, self.width)
                text += f"\n    {loc.source_line}\n    {caret}"
        if self.hint:
            text += f"\n    hint: {self.hint}"
        return text


class AttngenError(Exception):
    """Base of every error attngen raises on purpose."""


class SpecError(AttngenError):
    """A spec has one or more problems; `diagnostics` lists every one of them."""

    def __init__(self, diagnostics: list[Diagnostic]):
        self.diagnostics = tuple(diagnostics)
        super().__init__("\n".join(d.render() for d in self.diagnostics))


class BuildError(AttngenError):
    """Writing the generated package failed or would lose a file."""
