"""``luopan artifact status|diff``: a checked-out folder against its version, and two versions against each other."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ..artifact import ArtifactDiff, FileChange
from ..repo import Repo
from .app import JsonOpt, emit_json, human, opens_repo, out, table, usage_errors
from .artifact import artifact_app, split_ref

DIFFERS = 1  # the exit code of a status that found differences (as `git diff --exit-code` and diff(1))


@artifact_app.command("status")
@opens_repo
def status(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="NAME[@V]", help="Artifact (the version checked out in DIR) or "
                                                                "NAME@V to compare with.")],
    dest: Annotated[str, typer.Argument(metavar="DIR", help="A folder the artifact was checked out into.")],
    as_json: JsonOpt = False,
) -> None:
    """What differs between DIR and the version checked out there (or NAME@V): files modified, added and deleted,
    by content (luopan's own .luopan-checkout.json aside). Exit 0 when DIR matches the version, 1 when it differs (as
    `git diff --exit-code`); an error prints `error:` and exits with its own code (2 usage, 3 a damaged record, 4 not
    found)."""
    name, version = split_ref(ref)
    st = r.artifact(name).status(dest, version)
    if as_json:
        emit_json({"path": st.path, "ref": st.ref, "clean": st.clean, "complete": st.complete,
                   "modified": st.modified, "added": st.added, "deleted": st.deleted})
    else:
        out.print(f"{st.path} against {st.ref}:", highlight=False, markup=False)
        if not st.complete:
            out.print(f"  a checkout of {st.ref} was cut short here: run `luopan artifact checkout {st.ref} DIR` "
                      "again to finish it", highlight=False, markup=False)
        for word, paths in (("modified", st.modified), ("added", st.added), ("deleted", st.deleted)):
            for p in paths:
                out.print(f"  {word + ':':<10} {p}", highlight=False, markup=False)
        if st.clean:
            out.print("  clean: every file matches", highlight=False, markup=False)
    if not st.clean:
        raise typer.Exit(DIFFERS)


@artifact_app.command("diff")
@opens_repo
def diff(
    *,
    r: Repo,
    ref_a: Annotated[str, typer.Argument(metavar="NAME@A", help="The version to compare from.")],
    ref_b: Annotated[str, typer.Argument(metavar="NAME@B", help="The version to compare to (NAME alone: the "
                                                                "latest).")],
    as_json: JsonOpt = False,
) -> None:
    """The files added, removed and modified (content or mode) from NAME@A to NAME@B, with their sizes. The two may
    be versions of different artifacts."""
    name_a, version_a = split_ref(ref_a)
    name_b, version_b = split_ref(ref_b)
    with usage_errors():
        d = r.artifact(name_a).diff(version_a, f"{name_b}@{version_b if version_b is not None else _latest(r, name_b)}")
    if as_json:
        emit_json(diff_json(d))
        return
    t = table(title=f"{d.a} -> {d.b}")
    for col in ("change", "path", "size before", "size after"):
        t.add_column(col, justify="right" if col.startswith("size") else "left")
    for word, changes in (("added", d.added), ("removed", d.removed), ("modified", d.modified)):
        for c in changes:
            t.add_row(word, c.path, _size(c.size_a), _size(c.size_b))
    out.print(t)
    out.print(f"{len(d.added)} added, {len(d.removed)} removed, {len(d.modified)} modified, {d.unchanged} unchanged",
              highlight=False, markup=False)


def _latest(r: Repo, name: str) -> int:
    return r.artifact(name).get().version


def _size(n: int | None) -> str:
    return "—" if n is None else human(n)


def _change(c: FileChange) -> dict[str, Any]:
    return {"path": c.path, "size_a": c.size_a, "size_b": c.size_b,
            "mode_a": None if c.mode_a is None else oct(c.mode_a), "mode_b": None if c.mode_b is None else oct(c.mode_b)}


def diff_json(d: ArtifactDiff) -> dict[str, Any]:
    return {"a": d.a, "b": d.b, "added": [_change(c) for c in d.added], "removed": [_change(c) for c in d.removed],
            "modified": [_change(c) for c in d.modified], "unchanged": d.unchanged, "same": d.same}
