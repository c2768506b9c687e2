"""A dependency-free line plot written as PNG (zlib + struct): calibration loss per search step.

Just enough for one series: axes, tick marks, the polyline and a marker per point, with the y range printed in
the file name's companion CSV (no fonts here, so no text is drawn in the image)."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Sequence


def _png(width: int, height: int, rows: Sequence[bytearray]) -> bytes:
    raw = b"".join(b"\x00" + bytes(r) for r in rows)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def line_plot_png(path: str | Path, ys: Sequence[float], width: int = 480, height: int = 300) -> None:
    """Plot ys against 0..len(ys)-1 (x = search step) into `path`."""
    img = [bytearray(b"\xff\xff\xff" * width) for _ in range(height)]

    def put(x: int, y: int, rgb=(0, 0, 0)) -> None:
        if 0 <= x < width and 0 <= y < height:
            img[y][3 * x : 3 * x + 3] = bytes(rgb)

    left, right, top, bottom = 40, width - 20, 20, height - 30
    for x in range(left, right + 1):
        put(x, bottom)
    for y in range(top, bottom + 1):
        put(left, y)
    finite = [y for y in ys if y == y]
    if not finite:
        Path(path).write_bytes(_png(width, height, img))
        return
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    n = max(len(ys) - 1, 1)
    pts = [(left + round((right - left) * i / n), bottom - round((bottom - top) * (y - lo) / span))
           for i, y in enumerate(ys) if y == y]
    for i in range(len(ys)):  # x ticks, one per step
        x = left + round((right - left) * i / n)
        for d in range(4):
            put(x, bottom + 1 + d)
    for d in range(4):  # y ticks at the min and max
        put(left - 1 - d, top)
        put(left - 1 - d, bottom)
    blue = (31, 119, 180)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for t in range(steps + 1):
            x, y = x0 + (x1 - x0) * t // steps, y0 + (y1 - y0) * t // steps
            put(x, y, blue)
            put(x, y + 1, blue)
    for x, y in pts:
        for dx in range(-3, 4):
            for dy in range(-3, 4):
                put(x + dx, y + dy, (214, 39, 40))
    Path(path).write_bytes(_png(width, height, img))
