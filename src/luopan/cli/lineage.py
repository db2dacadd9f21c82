"""``luopan lineage NAME@V`` (what a version or checkpoint was made from and what used it) and ``luopan lineage link
RUN@STEP NAME@V`` (record an input afterwards, docs/format.md §9.4)."""

from __future__ import annotations

from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from ..repo import Repo
from .app import MARKUP, JsonOpt, app, emit_json, opens_repo, out, ref_argument, usage_errors


class _ShowByDefault(TyperGroup):
    """``luopan lineage NAME@V`` is ``luopan lineage show NAME@V``: a first argument that is no subcommand (a
    reference always holds '@', so it cannot be one) goes to ``show``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["show", *args]
        return super().parse_args(ctx, args)


lineage_app = typer.Typer(cls=_ShowByDefault, no_args_is_help=True, rich_markup_mode=MARKUP,
                          help="What NAME@V was made from and what used it (luopan lineage NAME@V), and linking an "
                               "input to a checkpoint afterwards (luopan lineage link RUN@STEP NAME@V).")
app.add_typer(lineage_app, name="lineage")


@lineage_app.command("show")
@opens_repo
def show(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="NAME@V", help="An artifact version or a checkpoint (run@step).")],
    as_json: JsonOpt = False,
) -> None:
    """What NAME@V was made from, up the graph (inputs in its manifest and those linked afterwards), and the
    checkpoints and artifact versions that used it. `luopan lineage NAME@V` for short."""
    with usage_errors():  # what lineage refuses as invalid is the NAME@V typed (a@x): exit 2
        lin = r.repository.lineage(ref)
    if as_json:
        emit_json({"ref": lin.ref, "kind": lin.kind, "parents": lin.parents, "linked": lin.linked,
                   "ancestors": lin.ancestors, "edges": [list(e) for e in lin.edges], "used_by": lin.used_by,
                   "missing": lin.missing})
        return
    out.print(f"{lin.ref} ({lin.kind})", highlight=False, markup=False)
    parents: dict[str, list[str]] = {}
    for child, parent in lin.edges:
        parents.setdefault(child, []).append(parent)
    shown = {lin.ref}
    stack = [(p, 1) for p in reversed(parents.get(lin.ref, []))]  # depth first, each node's parents once
    while stack:
        node, depth = stack.pop()
        gone = " (no longer in the repository)" if node in lin.missing else ""
        again = " (shown above)" if node in shown and parents.get(node) else ""
        linked = " (linked)" if depth == 1 and node in lin.linked else ""
        out.print(f"{'  ' * min(depth, 40)}<- {node}{linked}{gone}{again}", highlight=False, markup=False)
        if node not in shown:
            shown.add(node)
            stack.extend((p, depth + 1) for p in reversed(parents.get(node, [])))
    for kind, refs in sorted(lin.used_by.items()):
        for used in refs:
            out.print(f"  -> {used} ({kind})", highlight=False, markup=False)
    if not lin.edges and not lin.used_by:
        out.print("  no recorded parents or users", highlight=False)


@lineage_app.command("link")
@opens_repo
def link(
    *,
    r: Repo,
    ref: Annotated[str, typer.Argument(metavar="RUN@STEP", help="The checkpoint that was made from the inputs.")],
    inputs: Annotated[list[str], typer.Argument(metavar="NAME@V...", help="What it was made from: artifact versions "
                                                "(datasets/train@2) or checkpoints (base@100).")],
    as_json: JsonOpt = False,
) -> None:
    """Record NAME@V as an input of checkpoint RUN@STEP afterwards, as `save(..., inputs=[...])` would have: a small
    link file beside the checkpoint, never a change to its manifest. Linking again changes nothing; a link whose
    checkpoint is removed is dropped by `luopan gc`."""
    run, step = ref_argument(ref, "checkpoint (RUN@STEP)")
    with usage_errors():
        added = r.run(run).link_inputs(step, list(inputs))
    result: dict[str, Any] = {"ref": f"{run}@{step}", "linked": added,
                              "already": [i for i in inputs if i not in added]}
    if as_json:
        emit_json(result)
        return
    for i in added:
        out.print(f"linked {i} -> {run}@{step}", highlight=False, markup=False)
    if not added:
        out.print(f"nothing to link: {run}@{step} already names {', '.join(inputs)}", highlight=False, markup=False)
