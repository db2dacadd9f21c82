"""Small HTML pieces the report's sections share: escaped tables (each chart's text alternative), legends, slugs,
hover text naming a checkpoint, sizes and durations for people."""

from __future__ import annotations

import re
from collections.abc import Iterable
from html import escape

from ..units import format_bytes

NOT_RECORDED = "not recorded"


def size(n: float) -> str:
    return format_bytes(max(0, n))


def seconds(v: float | None) -> str:
    if v is None:
        return NOT_RECORDED
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def slug(text: str) -> str:
    """An id/attribute-safe form of a name (metric names may hold any character)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "x"


def table(headers: Iterable[str], rows: Iterable[Iterable[object]], *, caption: str = "", cls: str = "",
          collapsed: bool = True) -> str:
    """A table of plain-text cells (escaped here); ``collapsed``: inside a <details> (a chart's text alternative)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    cap = f"<caption>{escape(caption)}</caption>" if caption else ""
    t = (f'<div class="tablewrap"><table class="{escape(cls, quote=True)}">{cap}<thead><tr>{head}</tr></thead>'
         f"<tbody>{body}</tbody></table></div>")
    if not collapsed:
        return t
    return f'<details class="alt"><summary>Table{": " + escape(caption) if caption else ""}</summary>{t}</details>'


def legend(items: Iterable[tuple[str, str]]) -> str:
    """(css class, label) swatches above a chart."""
    return '<ul class="legend">' + "".join(f'<li><span class="sw {escape(c, quote=True)}"></span>{escape(t)}</li>'
                                          for c, t in items) + "</ul>"


def section(title: str, body: str, *, cls: str = "", attrs: str = "", level: int = 2) -> str:
    return (f'<section class="{escape(cls, quote=True)}"{attrs}><h{level}>{escape(title)}</h{level}>{body}'
            "</section>")


def para(text: str, cls: str = "") -> str:
    return f'<p class="{escape(cls, quote=True)}">{escape(text)}</p>' if cls else f"<p>{escape(text)}</p>"


def figure(heading: str, chart: str, alt_table: str, *, note: str = "", legend_html: str = "") -> str:
    n = f'<p class="note">{escape(note)}</p>' if note else ""
    return f'<figure><figcaption>{escape(heading)}</figcaption>{legend_html}{chart}{n}{alt_table}</figure>'


def metric_text(v: float) -> str:
    return f"{v:.6g}"
