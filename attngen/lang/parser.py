"""Stage: expression source text -> AST with source spans.

Goals: one small, unambiguous grammar (grammar.lark) shared by masks and score modifiers; every
node remembers where it came from, so later stages can point at the offending text.
Non-goals: types and names are not checked here (see typecheck.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import lark

MAX_EXPR_LENGTH = 4096
MAX_DEPTH = 64


@dataclass(frozen=True)
class Span:
    """Half-open character range [start, end) within the expression text."""

    start: int
    end: int


@dataclass(frozen=True)
class Node:
    span: Span


@dataclass(frozen=True)
class Num(Node):
    value: int | float


@dataclass(frozen=True)
class Name(Node):
    name: str


@dataclass(frozen=True)
class Call(Node):
    func: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Unary(Node):
    op: str  # "-" or "not"
    operand: Node


@dataclass(frozen=True)
class Binary(Node):
    op: str  # arithmetic, comparison, "and", "or"
    lhs: Node
    rhs: Node


class ParseError(Exception):
    """A syntax error at `offset` within the expression text."""

    def __init__(self, message: str, offset: int, width: int = 1):
        super().__init__(message)
        self.offset = offset
        self.width = width


@cache
def _parser() -> lark.Lark:
    grammar = (Path(__file__).with_name("grammar.lark")).read_text()
    return lark.Lark(grammar, parser="lalr", propagate_positions=True, maybe_placeholders=False)


def parse(text: str) -> Node:
    """Parse one expression; raises ParseError with the offset of the first problem."""
    if len(text) > MAX_EXPR_LENGTH:
        raise ParseError(f"expression is longer than {MAX_EXPR_LENGTH} characters", 0)
    if not text.isascii():
        offset = next(i for i, c in enumerate(text) if not c.isascii())
        raise ParseError(f"non-ASCII character {text[offset]!r} in expression", offset)
    if not text.strip():
        raise ParseError("empty expression", 0)
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedCharacters as e:
        raise ParseError(f"unexpected character {text[e.pos_in_stream]!r}", e.pos_in_stream) from None
    except lark.exceptions.UnexpectedToken as e:
        if e.token.type == "$END":
            raise ParseError("unexpected end of expression", len(text)) from None
        width = max(1, len(str(e.token)))
        raise ParseError(f"unexpected {str(e.token)!r}", e.token.start_pos, width) from None
    except lark.exceptions.UnexpectedEOF:
        raise ParseError("unexpected end of expression", len(text)) from None
    return _to_ast(tree, depth=0)


def _span(item: lark.Tree | lark.Token) -> Span:
    if isinstance(item, lark.Token):
        return Span(item.start_pos, item.end_pos)
    return Span(item.meta.start_pos, item.meta.end_pos)


def _to_ast(item: lark.Tree | lark.Token, depth: int) -> Node:
    if depth > MAX_DEPTH:
        raise ParseError(f"expression nested deeper than {MAX_DEPTH} levels", _span(item).start)
    span = _span(item)
    kids = item.children
    rule = item.data
    if rule == "int_lit":
        return Num(span, int(kids[0]))
    if rule == "float_lit":
        return Num(span, float(kids[0]))
    if rule == "var":
        return Name(span, str(kids[0]))
    if rule == "call":
        args = tuple(_to_ast(a, depth + 1) for a in kids[1:] if a is not None)
        return Call(span, str(kids[0]), args)
    if rule == "neg":
        return Unary(span, "-", _to_ast(kids[0], depth + 1))
    if rule == "not_":
        return Unary(span, "not", _to_ast(kids[0], depth + 1))
    if rule in ("or_", "and_"):
        op = rule.rstrip("_")
        node = _to_ast(kids[0], depth + 1)
        for rhs in kids[1:]:
            rhs_node = _to_ast(rhs, depth + 1)
            node = Binary(Span(node.span.start, rhs_node.span.end), op, node, rhs_node)
        return node
    if rule in ("compare", "arith"):
        # Left-associative chain: operand (OP operand)*.
        node = _to_ast(kids[0], depth + 1)
        for op_token, rhs in zip(kids[1::2], kids[2::2]):
            rhs_node = _to_ast(rhs, depth + 1)
            node = Binary(Span(node.span.start, rhs_node.span.end), str(op_token), node, rhs_node)
        return node
    raise AssertionError(f"unhandled grammar rule {rule!r}")
