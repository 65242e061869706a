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
# Every later stage (type checking, sympy, the printers) walks expressions recursively: a bound on
# their depth keeps those walks far from Python's recursion limit.
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
    text: str  # the literal as written, for messages about its range


@dataclass(frozen=True)
class Name(Node):
    name: str


@dataclass(frozen=True)
class Call(Node):
    func: str
    args: tuple[Node, ...]


@dataclass(frozen=True)
class Index(Node):
    """An element of a tensor param: `name[args]`."""

    name: str
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
    """A syntax error at `offset` within the expression text, with a hint where one helps."""

    def __init__(self, message: str, offset: int, width: int = 1, hint: str | None = None):
        super().__init__(message)
        self.offset = offset
        self.width = width
        self.hint = hint


# Operators of C, JavaScript or numpy that people write for the language's words.
_WORD_FOR = {"&": "and", "|": "or", "!": "not"}


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
        char = text[offset]
        raise ParseError(f"non-ASCII character {char!r} (U+{ord(char):04X}) in expression", offset)
    if not text.strip():
        raise ParseError("empty expression", 0)
    try:
        tree = _parser().parse(text)
    except lark.exceptions.UnexpectedCharacters as e:
        offset, char = e.pos_in_stream, text[e.pos_in_stream]
        if char in _WORD_FOR:  # (`!=` lexes as a comparison, so a `!` here is a negation)
            width = 2 if text[offset : offset + 2] == char * 2 else 1  # && and || as one operator
            operator = text[offset : offset + width]
            raise ParseError(
                f"unexpected {operator!r}", offset, width, hint=f"write `{_WORD_FOR[char]}` instead of `{operator}`"
            ) from None
        raise ParseError(f"unexpected character {char!r}", offset) from None
    except lark.exceptions.UnexpectedToken as e:
        if e.token.type == "$END":
            raise ParseError("unexpected end of expression", len(text)) from None
        width = max(1, len(str(e.token)))
        raise ParseError(f"unexpected {str(e.token)!r}", e.token.start_pos, width) from None
    except lark.exceptions.UnexpectedEOF:
        raise ParseError("unexpected end of expression", len(text)) from None
    return _to_ast(tree, depth=0)


def names(node: Node) -> frozenset[str]:
    """Every variable name node reads (not function names)."""
    if isinstance(node, Name):
        return frozenset({node.name})
    if isinstance(node, Call):
        return frozenset().union(*(names(a) for a in node.args))
    if isinstance(node, Index):
        return frozenset({node.name}).union(*(names(a) for a in node.args))
    if isinstance(node, Unary):
        return names(node.operand)
    if isinstance(node, Binary):
        return names(node.lhs) | names(node.rhs)
    return frozenset()


# Rules that chain operands (`a OP b OP c`); with one operand they only wrap it, once per
# precedence level, so a parenthesised operand arrives inside five of them and a `paren`.
_CHAINS = ("or_", "and_", "compare", "arith")


def _span(item: lark.Tree | lark.Token) -> Span:
    if isinstance(item, lark.Token):
        return Span(item.start_pos, item.end_pos)
    return Span(item.meta.start_pos, item.meta.end_pos)


def _is_wrapper(item: lark.Tree | lark.Token) -> bool:
    """Whether item only wraps its one child: parentheses, or a chain of one operand."""
    return isinstance(item, lark.Tree) and (item.data == "paren" or (item.data in _CHAINS and len(item.children) == 1))


def _too_deep(item: lark.Tree | lark.Token) -> ParseError:
    return ParseError(
        f"expression nested more than {MAX_DEPTH} levels deep (each operator of a chain is a level)",
        _span(item).start,
    )


def _to_ast(item: lark.Tree | lark.Token, depth: int) -> Node:
    """AST of a lark tree at nesting `depth`, counted in AST nodes, not in lark's wrappers."""
    # Iterative: parentheses nest wrappers as deep as the text allows, past the recursion limit.
    while _is_wrapper(item):
        item = item.children[0]
    if depth > MAX_DEPTH:
        raise _too_deep(item)
    span = _span(item)
    kids = item.children
    rule = item.data
    if rule == "int_lit":
        return Num(span, int(kids[0]), str(kids[0]))
    if rule == "float_lit":
        return Num(span, float(kids[0]), str(kids[0]))
    if rule == "var":
        return Name(span, str(kids[0]))
    if rule == "call":
        args = tuple(_to_ast(a, depth + 1) for a in kids[1:] if a is not None)
        return Call(span, str(kids[0]), args)
    if rule == "index":
        return Index(span, str(kids[0]), tuple(_to_ast(a, depth + 1) for a in kids[1:]))
    if rule == "neg":
        return Unary(span, "-", _to_ast(kids[0], depth + 1))
    if rule == "not_":
        return Unary(span, "not", _to_ast(kids[0], depth + 1))
    if rule not in _CHAINS:
        raise AssertionError(f"unhandled grammar rule {rule!r}")
    # A left-associative chain of n operands is n - 1 nested Binary nodes: its first operand
    # sits n - 1 levels below the chain, operand i (i >= 1) n - i levels.
    operands = kids if rule in ("or_", "and_") else kids[::2]
    ops = [rule.rstrip("_")] * (len(operands) - 1) if rule in ("or_", "and_") else [str(t) for t in kids[1::2]]
    if depth + len(operands) - 1 > MAX_DEPTH:
        raise _too_deep(item)
    node = _to_ast(operands[0], depth + len(operands) - 1)
    for i, (op, rhs) in enumerate(zip(ops, operands[1:]), start=1):
        # The operands' own spans: they include the parentheses around an operand.
        span = Span(_span(operands[0]).start, _span(rhs).end)
        node = Binary(span, op, node, _to_ast(rhs, depth + len(operands) - i))
    return node
