"""Stage: mask IR -> tile bounds (sympy); see tiles.py."""

from attngen.analysis.tiles import TileBounds, analyse_mask

__all__ = ["TileBounds", "analyse_mask"]
