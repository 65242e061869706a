"""A minimal PNG writer: 8-bit RGB, no interlacing, in pure Python (zlib and struct).

Input: an image's size and its RGB bytes. Output: the bytes of a valid PNG file (PNG spec, ISO/IEC 15948:
signature, IHDR, one IDAT, IEND; each chunk with its CRC-32). attngen draws tile maps with it so
that `attngen explain` needs no plotting library.
"""

from __future__ import annotations

import struct
import zlib

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    """length, type, data, then the CRC-32 of type and data."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def encode(width: int, height: int, rgb: bytes) -> bytes:
    """PNG bytes of a width x height image given as its RGB bytes, row by row, top row first."""
    if width < 1 or height < 1 or len(rgb) != width * height * 3:
        raise ValueError(f"{len(rgb)} bytes are not a {width} x {height} RGB image")
    # IHDR: width, height, bit depth 8, colour type 2 (RGB), compression 0, filter 0, no interlace.
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    # Each scanline starts with its filter type: 0, none (tile maps are runs of flat colour and
    # compress well as they are).
    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    return SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; ValueError if data does not start like a PNG."""
    if data[:8] != SIGNATURE or data[12:16] != b"IHDR":
        raise ValueError("not a PNG: no signature and IHDR chunk")
    return struct.unpack(">II", data[16:24])
