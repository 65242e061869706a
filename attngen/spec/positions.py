"""Where things are in a spec's text: TOML keys, table headers and each character of a string.

tomllib keeps no positions; every error attngen reports about a spec points at file:line:col
with the offending text underlined, so this module recovers them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from attngen.errors import Location

Key = tuple[str, ...]  # a dotted key path, e.g. ("mask", "expr")

# TOML's escapes in basic strings (\e and \xHH are TOML 1.1, which newer tomllib reads).
_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", "e": "\x1b", '"': '"', "\\": "\\"}
_HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}


class TomlPositions:
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
class Spot:
    """Where a problem is and how many characters of it to underline."""

    location: Location
    width: int = 1


class Locator:
    """Source positions for a spec's text: offsets, keys and characters inside string values."""

    def __init__(self, path: str, text: str):
        self.path = path
        # Lines end at "\n" only, as TOML (and tomllib's error positions) count them.
        self.lines = [line.removesuffix("\r") for line in text.split("\n")]
        self.line_starts = [0]
        for line in text.split("\n")[:-1]:
            self.line_starts.append(self.line_starts[-1] + len(line) + 1)
        self.toml: TomlPositions | None = None  # filled in once tomllib has accepted the text

    def at(self, offset: int, width: int = 1) -> Spot:
        line = bisect.bisect_right(self.line_starts, offset)
        col = offset - self.line_starts[line - 1] + 1
        return Spot(Location(self.path, line, col, self.lines[line - 1]), width)

    def line_col(self, line: int, col: int) -> Spot:
        line = min(max(line, 1), len(self.lines))
        return self.at(self.line_starts[line - 1] + max(col, 1) - 1)

    def start(self) -> Spot:
        return self.at(0)

    def key(self, *path: str) -> Spot:
        """The key at `path`, else its nearest enclosing table, else the start of the file."""
        keys = self.toml.keys if self.toml else {}
        for n in range(len(path), 0, -1):
            if path[:n] in keys:
                start, end = keys[path[:n]]
                return self.at(start, end - start)
        return self.start()

    def value(self, *path: str, start: int = 0, end: int | None = None) -> Spot:
        """Characters [start, end) of the string value at `path` (the key if it has none)."""
        offsets = self.toml.strings.get(path) if self.toml else None
        if offsets is None:
            return self.key(*path)
        first = offsets[min(start, len(offsets) - 1)]
        last = offsets[min(end, len(offsets) - 1)] if end is not None else first + 1
        spot = self.at(first, last - first)
        # A span over several lines (of a multi-line string) is underlined to its first line's end.
        room = max(1, len(spot.location.source_line) - spot.location.col + 1)
        return Spot(spot.location, min(spot.width, room))
