"""``luopan index ls|rollback``: vector-index snapshots (luopan.index) — list them, move the live version."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from ..errors import UsageError
from ..index import IndexStore
from ..index import INDEX_KIND
from ..repo import Repo
from .app import (
    MARKUP,
    JsonOpt,
    app,
    emit_json,
    human,
    opens_repo,
    out,
    table,
)
from .grammar import checkpoint_ref

index_app = typer.Typer(help="Vector-index snapshots (FAISS): list versions, roll the live one back.",
                        no_args_is_help=True, rich_markup_mode=MARKUP)
app.add_typer(index_app, name="index")


def _version_json(idx: IndexStore, info: dict[str, Any], live: int | None, pins: dict[int, Any]) -> dict[str, Any]:
    return {"name": idx.name, "version": info["version"], "ref": f"{idx.name}@{info['version']}",
            "live": info["version"] == live, "pinned": info["version"] in pins, "created": info["created"],
            "index_type": info["index_type"], "dim": info["dim"], "ntotal": info["ntotal"], "params": info["params"],
            "metadata": info["metadata"], **info["stats"]}


@index_app.command("ls")
@opens_repo
def ls(
    *,
    r: Repo,
    name: Annotated[str | None, typer.Argument(help="Index whose versions to list; all indexes when omitted.")]
    = None,
    as_json: JsonOpt = False,
) -> None:
    """List indexes with their live version, or every version of index NAME."""
    if name is None:
        rows = []
        for n in INDEX_KIND.scan(r.store, None, False).runs:
            idx = IndexStore(r, n)
            live = idx.current()
            rows.append((idx, live, idx.info(live) if live is not None else None, len(idx.versions())))
        if as_json:
            emit_json({"indexes": [{"name": idx.name, "live": live, "versions": count,
                                    **({"index_type": i["index_type"], "ntotal": i["ntotal"],
                                        "logical_bytes": i["stats"]["logical_bytes"]} if i else {})}
                                   for idx, live, i, count in rows]})
            return
        if not rows:
            out.print("no indexes yet")
            return
        t = table(title=f"indexes in {r.where}")
        for col in ("index", "live", "versions", "type", "vectors", "size"):
            t.add_column(col, justify="left" if col in ("index", "type") else "right")
        for idx, live, i, count in rows:
            t.add_row(idx.name, str(live), str(count), i["index_type"] if i else "-",
                      str(i["ntotal"]) if i else "-", human(i["stats"]["logical_bytes"]) if i else "-")
        out.print(t)
        return
    idx = IndexStore(r, name)
    versions = idx.versions()
    if not versions:
        raise idx._missing()
    live, pins = idx.current(), idx.pins()
    infos = [_version_json(idx, idx.info(v), live, pins) for v in versions]
    if as_json:
        emit_json({"name": idx.name, "live": live, "versions": infos})
        return
    t = table(title=f"versions of index {idx.name}")
    for col in ("version", "created", "type", "vectors", "size", "written", "metadata"):
        t.add_column(col, justify="left" if col in ("created", "type", "metadata") else "right")
    for v in infos:
        mark = " (live)" if v["live"] else ""
        mark += " (pinned)" if v["pinned"] else ""
        t.add_row(f"{v['version']}{mark}", v["created"][:19], v["index_type"], str(v["ntotal"]),
                  human(v["logical_bytes"]), human(v["stored_bytes"]),
                  " ".join(f"{k}={val}" for k, val in v["metadata"].items()))
    out.print(t)


@index_app.command("rollback")
@opens_repo
def rollback(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="NAME@V", help="The index version to make live.")],
    legacy_version: Annotated[Optional[int], typer.Argument(hidden=True, show_default=False,
                                                            help="Deprecated: give NAME@V.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Make version V the live version of index NAME (atomically); ops logged against other versions are not
    replayed on it."""
    name, version = checkpoint_ref(ref, legacy_version, "index rollback", old="NAME V", quiet=as_json,
                                   what="index version (NAME@V)")
    if version is None:
        raise UsageError(f"a version is needed: {name}@V")
    idx = IndexStore(r, name)
    previous = idx.current()
    idx.rollback(version)
    if as_json:
        emit_json({"name": idx.name, "version": version, "previous": previous})
        return
    out.print(f"{idx.name}: live version is now {version} (was {previous})", highlight=False, markup=False)
