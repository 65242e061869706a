"""Where a compiled NVIDIA kernel spills: its SASS (`cuobjdump -sass`) as a control-flow graph, its
loops found by dominators, and the spill instructions (STL / LDL, local memory) inside them.

A spill inside a loop costs every iteration; one outside it (a program's setup, its epilogue) costs
once. The stack frame's size alone cannot tell them apart (a persistent Hopper kernel nests its kv
loop in a loop over tiles: two deep is its hot path).

A loop comes from a back edge: a branch to a block that dominates it (every path from the entry to the
branch passes through that block). An address order alone would mistake for loops the branches
that jump back from code ptxas places after the kernel's end (a rarely taken path returning to
where it left). Code reached only through an indirect branch (BRX: warp specialization's partitions)
has no edge from the entry; its first block starts a walk of its own.
"""

from __future__ import annotations

import re

_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+([^;]*);", re.MULTILINE)
_SPILL = re.compile(r"^(STL|LDL)\b")
_INDIRECT = ("BRX", "JMX")  # targets in registers: no edge known
_ENDS = ("EXIT", "RET", "BPT.TRAP", "KILL")  # no successor


def spills_by_loop_depth(sass: str) -> tuple[int, ...]:
    """The spill instructions of the one kernel of `sass` (cuobjdump -sass text) by how many loops
    hold them: [0] outside every loop (once a program), [1] in loops one deep, ..."""
    code = [(int(address, 16), text.strip()) for address, text in _INSTRUCTION.findall(sass)]
    blocks, successors = _blocks(code)
    depth = _loop_depths(successors)
    by_depth = [0] * (max(depth, default=0) + 1)
    for (first, end), d in zip(blocks, depth):
        by_depth[d] += sum(bool(_SPILL.match(_opcode(text))) for _, text in code[first:end])
    while len(by_depth) > 1 and not by_depth[-1]:
        by_depth.pop()
    return tuple(by_depth)


def _opcode(text: str) -> str:
    """The instruction without its guard predicate (`@P0`, `@!UP1`)."""
    return text.split(None, 1)[1] if text.startswith("@") and " " in text else text


def _jumps(code: list[tuple[int, str]]) -> list[tuple[list[int], bool] | None]:
    """Per instruction: None if it passes control on to the next, else (the instructions it may
    jump to, whether it may also fall through to the next)."""
    index = {address: i for i, (address, _) in enumerate(code)}
    jumps = []
    for _, text in code:
        guarded, op = text.startswith("@"), _opcode(text)
        name = op.split(None, 1)[0]
        if name.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)\s*$", op)
            to = [index[int(target.group(1), 16)]] if target and int(target.group(1), 16) in index else []
            # A guarded branch, or one on a condition of its own (BRA.U.ANY UP0, ...), may fall through.
            jumps.append((to, guarded or "," in op or not to))
        elif name.startswith(_INDIRECT + _ENDS):
            jumps.append(([], guarded))
        else:
            jumps.append(None)
    return jumps


def _blocks(code: list[tuple[int, str]]) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """The basic blocks, as [first, end) instruction ranges, and each block's successor blocks."""
    jumps = _jumps(code)
    leaders = {0} | {t for j in jumps if j for t in j[0]} | {i + 1 for i, j in enumerate(jumps) if j}
    starts = sorted(i for i in leaders if i < len(code))
    blocks = list(zip(starts, starts[1:] + [len(code)]))
    block_of = {first: b for b, (first, _) in enumerate(blocks)}
    successors = []
    for b, (_, end) in enumerate(blocks):
        jump = jumps[end - 1]
        to, falls = jump if jump else ([], True)
        successors.append([block_of[t] for t in to] + ([b + 1] if falls and b + 1 < len(blocks) else []))
    return blocks, successors


def _loop_depths(successors: list[list[int]]) -> list[int]:
    """Per block, how many loops hold it (a loop: a header and the bodies of its back edges)."""
    predecessors = [[] for _ in successors]
    for node, nexts in enumerate(successors):
        for n in nexts:
            predecessors[n].append(node)
    order, roots = _reverse_postorder(successors)
    dominator = _dominators(order, roots, predecessors)
    loops = {}  # header -> body
    for node in order:
        for header in successors[node]:
            if _dominates(dominator, header, node):  # a back edge: node -> header
                loops[header] = loops.get(header, set()) | _natural_loop(header, node, predecessors)
    depth = [0] * len(successors)
    for body in loops.values():
        for block in body:
            depth[block] += 1
    return depth


def _reverse_postorder(successors: list[list[int]]) -> tuple[list[int], set[int]]:
    """The blocks in reverse postorder of depth-first walks from the entry, then from the first
    block no walk reached (code entered through an indirect branch), and so on; and those roots."""
    seen, postorder, roots = [False] * len(successors), [], set()
    for root in range(len(successors)):
        if seen[root]:
            continue
        roots.add(root)
        seen[root] = True
        stack = [(root, iter(successors[root]))]
        while stack:
            node, nexts = stack[-1]
            for n in nexts:
                if not seen[n]:
                    seen[n] = True
                    stack.append((n, iter(successors[n])))
                    break
            else:
                stack.pop()
                postorder.append(node)
    return postorder[::-1], roots


def _dominators(order: list[int], roots: set[int], predecessors: list[list[int]]) -> dict[int, int]:
    """Each block's immediate dominator, by Cooper, Harvey and Kennedy's iteration over the reverse
    postorder; the walks' roots hang from one virtual root, -1."""
    rank = {-1: -1, **{node: r for r, node in enumerate(order)}}
    dominator = {-1: -1}

    def meet(a: int, b: int) -> int:
        while a != b:
            while rank[a] > rank[b]:
                a = dominator[a]
            while rank[b] > rank[a]:
                b = dominator[b]
        return a

    changed = True
    while changed:
        changed = False
        for node in order:
            new = -1 if node in roots else None
            for p in predecessors[node]:
                if p in dominator:
                    new = p if new is None else meet(p, new)
            if dominator.get(node) != new:
                dominator[node] = new
                changed = True
    return dominator


def _dominates(dominator: dict[int, int], a: int, b: int) -> bool:
    """Whether block a dominates block b (every block dominates itself)."""
    while b != -1:
        if a == b:
            return True
        b = dominator[b]
    return False


def _natural_loop(header: int, latch: int, predecessors: list[list[int]]) -> set[int]:
    """The loop of the back edge latch -> header: the header and the blocks that reach the latch
    without passing through it."""
    body, stack = {header, latch}, [] if latch == header else [latch]
    while stack:
        for p in predecessors[stack.pop()]:
            if p not in body:
                body.add(p)
                stack.append(p)
    return body
