"""Inline SVG charts, drawn here (no chart library, no script): line charts with marked points, stacked and grouped
bar charts, a strip of cells. Colours come from CSS classes (luopan.report.page), so one chart serves light and dark
schemes; every point, bar and cell carries a ``<title>`` (hover text) and ``data-*`` attributes."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from html import escape

WIDTH = 1100  # viewBox units; the SVG scales to the page's width
LEFT, RIGHT, TOP, BOTTOM = 78, 18, 14, 42


def attr(attrs: dict[str, str | int | float]) -> str:
    return "".join(f' {k}="{escape(str(v), quote=True)}"' for k, v in attrs.items())


def title(text: str) -> str:
    return f"<title>{escape(text)}</title>"


def num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round values spanning [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    out = []
    v = first
    while v <= hi + step * 1e-9 and len(out) < 50:
        out.append(0.0 if abs(v) < step * 1e-9 else v)
        v += step
    return out


def value_ticks(lo: float, hi: float, n: int, binary: bool) -> list[float]:
    """``nice_ticks``, in steps round in a binary unit (KiB, MiB, …) when ``binary`` (byte axes)."""
    if not binary or hi <= 1024:
        return nice_ticks(lo, hi, n)
    base = 1024.0 ** min(4, int(math.log(max(hi, 1.0), 1024)))
    return [v * base for v in nice_ticks(lo / base, hi / base, n)]


def general(v: float) -> str:
    return f"{v:.4g}"


@dataclass
class Point:
    x: float
    y: float
    title: str
    cls: str = ""
    attrs: dict[str, str | int | float] = field(default_factory=dict)
    r: float = 4.0


@dataclass
class Series:
    name: str
    cls: str
    points: list[Point]
    line: bool = True
    attrs: dict[str, str | int | float] = field(default_factory=dict)  # on the series' line (e.g. data-run)


def _domain(values: list[float], zero: bool = False) -> tuple[float, float]:
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    if zero:
        lo = min(lo, 0.0)
    if hi == lo:
        pad = abs(hi) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    else:
        pad = (hi - lo) * 0.06
        lo, hi = (lo if zero and lo == 0 else lo - pad), hi + pad
    return lo, hi


def _frame(height: int, x_ticks: list[tuple[float, str]], y_ticks: list[tuple[float, str]], x_label: str,
           y_label: str, width: int = WIDTH) -> list[str]:
    """Grid, axes and their labels (positions already in SVG units)."""
    bottom = height - BOTTOM
    out = ['<g class="grid">']
    for y, text in y_ticks:
        out.append(f'<line x1="{LEFT}" x2="{width - RIGHT}" y1="{num(y)}" y2="{num(y)}"/>')
    out.append("</g><g class=\"axis\">")
    out.append(f'<line x1="{LEFT}" x2="{width - RIGHT}" y1="{bottom}" y2="{bottom}"/>')
    out.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{bottom}"/>')
    for y, text in y_ticks:
        out.append(f'<text x="{LEFT - 6}" y="{num(y + 4)}" text-anchor="end">{escape(text)}</text>')
    for x, text in x_ticks:
        out.append(f'<line x1="{num(x)}" x2="{num(x)}" y1="{bottom}" y2="{bottom + 4}"/>'
                   f'<text x="{num(x)}" y="{bottom + 17}" text-anchor="middle">{escape(text)}</text>')
    out.append(f'<text class="label" x="{(LEFT + width - RIGHT) / 2:.0f}" y="{height - 6}" '
               f'text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text class="label" transform="translate(14 {(TOP + bottom) / 2:.0f}) rotate(-90)" '
               f'text-anchor="middle">{escape(y_label)}</text></g>')
    return out


def line_chart(attrs: dict[str, str | int | float], series: list[Series], *, ticks: list[Point] | None = None,
               x_label: str = "step", y_label: str = "", y_fmt: Callable[[float], str] = general,
               height: int = 250, zero: bool = False, aria: str = "", binary: bool = False,
               width: int = WIDTH) -> str:
    """Series of points joined by lines against x; ``ticks`` are marks along the x axis (every checkpoint)."""
    xs = [p.x for s in series for p in s.points] + [t.x for t in ticks or []]
    ys = [p.y for s in series for p in s.points]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = _domain(ys, zero)
    bottom = height - BOTTOM
    sx = lambda x: LEFT + 8 + (x - x0) / (x1 - x0) * (width - RIGHT - LEFT - 16)  # noqa: E731
    sy = lambda y: bottom - 6 - (y - y0) / (y1 - y0) * (bottom - TOP - 12)  # noqa: E731
    whole = all(float(x).is_integer() for x in xs)  # steps, save numbers: no tick between two integers
    x_ticks = [(sx(v), general(v)) for v in nice_ticks(x0, x1, max(3, width // 140))
               if x0 <= v <= x1 and (not whole or float(v).is_integer())]
    y_ticks = [(sy(v), y_fmt(v)) for v in value_ticks(y0, y1, 5, binary) if y0 <= v <= y1]
    out = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img"{attr(attrs)}'
           f' aria-label="{escape(aria, quote=True)}">']
    out += _frame(height, x_ticks, y_ticks, x_label, y_label, width)
    for t in ticks or []:
        out.append(f'<g class="tick {escape(t.cls)}"{attr(t.attrs)}>{title(t.title)}'
                   f'<rect x="{num(sx(t.x) - 2)}" y="{bottom - 9}" width="4" height="9"/></g>')
    for s in series:
        pts = sorted(s.points, key=lambda p: p.x)
        if s.line and len(pts) > 1:
            path = " ".join(f"{'M' if i == 0 else 'L'}{num(sx(p.x))},{num(sy(p.y))}" for i, p in enumerate(pts))
            out.append(f'<path class="line {escape(s.cls)}"{attr(s.attrs)} d="{path}"/>')
        for p in pts:
            out.append(f'<circle class="pt {escape(s.cls)} {escape(p.cls)}" cx="{num(sx(p.x))}" cy="{num(sy(p.y))}" '
                       f'r="{p.r}"{attr(p.attrs)}>{title(p.title)}</circle>')
    out.append("</svg>")
    return "".join(out)


@dataclass
class Part:
    """One segment of a bar (stacked on the segments before it in its stack)."""

    name: str
    value: float
    cls: str
    title: str


@dataclass
class Group:
    """One x position of a bar chart: stacks drawn side by side, each a list of parts stacked bottom up."""

    label: str
    stacks: list[list[Part]]
    attrs: dict[str, str | int | float] = field(default_factory=dict)


def bar_chart(attrs: dict[str, str | int | float], groups: list[Group], *, x_label: str = "", y_label: str = "",
              y_fmt: Callable[[float], str] = general, height: int = 250, aria: str = "",
              binary: bool = False) -> str:
    totals = [sum(p.value for p in st) for g in groups for st in g.stacks]
    y0, y1 = _domain(totals or [1.0], zero=True)
    y0 = 0.0
    bottom = height - BOTTOM
    plot_w = WIDTH - RIGHT - LEFT - 8
    band = plot_w / max(1, len(groups))
    sy = lambda y: bottom - (y - y0) / (y1 - y0) * (bottom - TOP - 6)  # noqa: E731
    every = max(1, math.ceil(len(groups) / 14))
    x_ticks = [(LEFT + 4 + band * (i + 0.5), g.label) for i, g in enumerate(groups) if i % every == 0]
    y_ticks = [(sy(v), y_fmt(v)) for v in value_ticks(y0, y1, 5, binary) if y0 <= v <= y1]
    out = [f'<svg class="chart" viewBox="0 0 {WIDTH} {height}" role="img"{attr(attrs)}'
           f' aria-label="{escape(aria, quote=True)}">']
    out += _frame(height, x_ticks, y_ticks, x_label, y_label)
    for i, g in enumerate(groups):
        inner = min(band * 0.8, 44.0 * len(g.stacks))  # few saves: bars of a readable width, centred
        width = inner / max(1, len(g.stacks))
        out.append('<g class="group">')
        for j, stack in enumerate(g.stacks):
            x = LEFT + 4 + band * i + (band - inner) / 2 + width * j
            base = 0.0
            for p in stack:
                if p.value <= 0:
                    continue
                top, low = sy(base + p.value), sy(base)
                out.append(f'<rect class="bar {escape(p.cls)}" data-part="{escape(p.name, quote=True)}"'
                           f'{attr(g.attrs)} x="{num(x)}" y="{num(top)}" width="{num(max(width - 1, 0.6))}" '
                           f'height="{num(max(low - top, 0.6))}">{title(p.title)}</rect>')
                base += p.value
        out.append("</g>")
    out.append("</svg>")
    return "".join(out)


@dataclass
class Cell:
    label: str
    cls: str
    title: str
    attrs: dict[str, str | int | float] = field(default_factory=dict)


def strip(attrs: dict[str, str | int | float], cells: list[Cell], *, aria: str = "") -> str:
    """One row of cells (one per checkpoint), coloured by class: where each lives."""
    height = 46
    plot_w = WIDTH - RIGHT - LEFT
    w = plot_w / max(1, len(cells))
    every = max(1, math.ceil(len(cells) / 14))
    out = [f'<svg class="chart strip" viewBox="0 0 {WIDTH} {height}" role="img"{attr(attrs)}'
           f' aria-label="{escape(aria, quote=True)}">']
    for i, c in enumerate(cells):
        x = LEFT + w * i
        out.append(f'<rect class="cell {escape(c.cls)}"{attr(c.attrs)} x="{num(x)}" y="4" '
                   f'width="{num(max(w - 1, 0.6))}" height="22">{title(c.title)}</rect>')
        if i % every == 0:
            out.append(f'<text class="axis-text" x="{num(x + w / 2)}" y="40" text-anchor="middle">'
                       f'{escape(c.label)}</text>')
    out.append("</svg>")
    return "".join(out)
