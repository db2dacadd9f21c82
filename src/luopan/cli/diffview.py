"""``luopan diff`` as a table: per entry what changed, the bytes that differ and the size of the change (relative L2
norm, max abs difference, elements differing), then the config keys that differ."""

from __future__ import annotations

import json
import math
from typing import Any

from .app import human, out, table


def number(v: Any) -> str:
    """A figure of the change: "-" when none was computed (layout changed, --bytes-only, integers' L2)."""
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _value(v: Any) -> str:
    text = json.dumps(v, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def print_diff(d: dict[str, Any], title: str, values: bool) -> None:
    t = table(title=title)
    cols = ["change", "entry", "dtype", "shape", "bytes differing"]
    if values:
        cols += ["rel L2", "max abs", "elements differing"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("change", "entry", "dtype", "shape") else "right")
    for c in d["changed"]:
        what = "changed" if c["was"] is None else f"changed (was {c['was']['dtype']}{tuple(c['was']['shape'])})"
        size = f"= {c['tied_to']}" if c["tied_to"] else f"{human(c['changed_bytes'])} of {human(c['nbytes'])}"
        row = [what, c["path"], c["dtype"], str(tuple(c["shape"])), size]
        if values:
            row += [number(c.get("rel_l2")), number(c.get("max_abs")), number(c.get("differing"))]
        t.add_row(*row)
    for kind in ("added", "removed"):
        for c in d[kind]:
            t.add_row(kind, c["path"], c["dtype"], str(tuple(c["shape"])), human(c["nbytes"]),
                      *(["", "", ""] if values else []))
    out.print(t)
    out.print(f"{len(d['changed'])} changed, {len(d['added'])} added, {len(d['removed'])} removed, "
              f"{d['unchanged']} unchanged; {human(d['changed_bytes'])} differ", highlight=False)
    cfg = d.get("config") or {}
    if cfg.get("changed") or cfg.get("added") or cfg.get("removed"):
        c = table(title="config")
        for col in ("key", "from", "to"):
            c.add_column(col)
        for k, (a, b) in cfg["changed"].items():
            c.add_row(k, _value(a), _value(b))
        for k, b in cfg["added"].items():
            c.add_row(k, "(absent)", _value(b))
        for k, a in cfg["removed"].items():
            c.add_row(k, _value(a), "(absent)")
        out.print(c)
    out.print(f"config: {len(cfg.get('changed', {}))} key(s) differ, {len(cfg.get('added', {}))} added, "
              f"{len(cfg.get('removed', {}))} removed, {cfg.get('same', 0)} the same", highlight=False)
