"""``luopan plan``: the checkpoint cost table (the arithmetic lives in luopan.plan)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from .. import plan as _plan
from .app import JsonOpt, app, emit_json, err, handles_errors, human, out, table

def _plan_arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a `luopan.plan` parser so its PlanInputError becomes a usage error (exit 2) with its message."""
    def convert(text: Any) -> Any:
        if not isinstance(text, str):  # already converted (defaults, repeated conversion)
            return text
        try:
            return parse(text)
        except _plan.PlanInputError as exc:
            raise typer.BadParameter(str(exc)) from None
    return convert


@app.command(help="\n\n".join((
    "Checkpoint cost table: size, time per save, overhead at intervals, Young/Daly interval; full vs incremental.",
    "Decimal units like the reference article (1 GB = 10^9 bytes, 1 MB/s = 10^6 bytes/s). Size = parameters × "
    "(weight bytes + fp32 master copy if --master-weights fp32 + fp32 optimizer state); gradients are not counted. "
    "Time per save C = size / bandwidth; save overhead at interval T = C/T. With --mtbf M: Young/Daly interval "
    "T* = sqrt(2·C·M) and the expected overhead C/T + T/(2·M) (save time + half an interval of work lost per "
    "failure). Incremental (--lora-fraction f): each save rewrites only the f × params trainable weights and their "
    "optimizer state; the frozen base weights are written once.",
    "The defaults (bf16 weights + two fp32 Adam moments, no master copy: 10 B/param) are the article's "
    "configuration: `luopan plan --params 7B --params 70B --bandwidth 500MB/s --interval 2h --interval 4h` gives "
    "70 GB / 140 s / 1.9% for 7B (the article itemises 14 + 56 GB, then rounds up to ~80 GB / ~160 s / ~2.2% for "
    "unquantified \"gradients and misc\") and 700 GB / 1,400 s for 70B, as the article.")))
@handles_errors
def plan(
    params: Annotated[list[float], typer.Option(
        "--params", parser=_plan_arg(_plan.parse_count), metavar="N", show_default=False,
        help="Model size; repeat for several: --params 7B --params 70B (also 350M, 1.5e9).")],
    weights: Annotated[Literal["bf16", "fp16", "fp32"], typer.Option(
        help="Weight dtype: bf16/fp16 2 B, fp32 4 B per parameter.")] = "bf16",
    optimizer: Annotated[Literal["adam", "sgd-momentum", "sgd", "none"], typer.Option(
        help="Optimizer state, fp32: adam 2 moments (8 B), sgd-momentum 1 buffer (4 B), sgd/none 0 B.")] = "adam",
    master_weights: Annotated[Literal["none", "fp32"], typer.Option(
        help="fp32 master copy of bf16/fp16 weights (4 B), as DeepSpeed/Megatron keep. The article does not "
             "count one: leave it at none to reproduce it.")] = "none",
    bandwidth: Annotated[Optional[float], typer.Option(
        parser=_plan_arg(_plan.parse_rate), metavar="RATE", show_default=False,
        help="Write bandwidth, e.g. 500MB/s or 1GB/s (decimal; MiB/s, GiB/s binary).")] = None,
    probe: Annotated[Optional[str], typer.Option(
        metavar="DIR", help="Measure the bandwidth instead: an fsync'd write of a temporary file in DIR "
                            "(removed afterwards).")] = None,
    probe_size: Annotated[int, typer.Option(parser=_plan_arg(_plan.parse_bytes), metavar="SIZE",
                                            help="Bytes the probe writes, e.g. 256MiB or 1GB.")]
    = "256MiB",  # type: ignore[assignment]  (parsed by the parser, like a typed value)
    interval: Annotated[Optional[list[float]], typer.Option(
        parser=_plan_arg(_plan.parse_duration), metavar="DURATION", show_default=False,
        help="Save interval; repeat for several: --interval 2h --interval 30m (s, m, h, d, w). Default 2h.")] = None,
    mtbf: Annotated[Optional[float], typer.Option(
        parser=_plan_arg(_plan.parse_duration), metavar="DURATION", show_default=False,
        help="Mean time between failures, e.g. 24h: adds the Young/Daly interval sqrt(2*C*MTBF).")] = None,
    lora_fraction: Annotated[Optional[float], typer.Option(
        parser=_plan_arg(_plan.parse_fraction), metavar="FRACTION", show_default=False,
        help="Trainable fraction of the parameters (LoRA), e.g. 0.01 or 1%: adds the incremental column.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Checkpoint cost table (the help text is above; the arithmetic lives in `luopan.plan`)."""
    if (bandwidth is None) == (probe is None):
        raise typer.BadParameter("give --bandwidth RATE (e.g. 500MB/s) or --probe DIR"
                                 + (", not both" if probe else ""), param_hint="--bandwidth / --probe")
    intervals = interval or [7200.0]
    accounting = _plan.Accounting(weights, optimizer, master_weights)
    measured = None
    if probe is not None:
        _plan.check_probe_dir(probe)  # before the progress bar starts
        with Progress(TextColumn("probing {task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      console=err, transient=True) as bar:
            task = bar.add_task(probe, total=probe_size)  # the path as written: no markup, no format fields
            measured = _plan.probe_bandwidth(probe, probe_size, progress=lambda n: bar.advance(task, n))
        bandwidth = measured.bytes_per_second
    assert bandwidth is not None
    plans = [_plan.plan_model(p, accounting, bandwidth, intervals, mtbf, lora_fraction) for p in params]
    source = ("given" if measured is None else
              f"measured: {human(measured.nbytes)} written + fsync'd in {measured.path} "
              f"in {measured.seconds:.2f} s")
    if as_json:
        emit_json({"units": "decimal: 1 GB = 1e9 bytes, 1 MB/s = 1e6 bytes/s",
                    "accounting": {"weights": weights, "optimizer": optimizer, "master_weights": master_weights,
                                   "bytes_per_param": accounting.bytes_per_param(), "gradients": False},
                    "bandwidth_bytes_per_s": bandwidth,
                    "probe": None if measured is None else {"path": measured.path, "bytes": measured.nbytes,
                                                             "seconds": measured.seconds},
                    "intervals_s": intervals, "mtbf_s": mtbf, "lora_fraction": lora_fraction,
                    "models": [p.to_json() for p in plans]})
        return
    out.print("units: decimal (1 GB = 10^9 B, 1 MB/s = 10^6 B/s), as in the reference article")
    out.print(f"per parameter: {accounting.describe()}; gradients not counted", highlight=False)
    out.print(f"bandwidth: {bandwidth / 1e6:,.0f} MB/s ({source})", highlight=False, markup=False)
    for p in plans:
        t = table(title=f"{_plan.format_count(p.params)} parameters", title_justify="left")
        t.add_column("")
        for header in p.columns():
            t.add_column(header, justify="right")
        for label, cells in p.rows():
            t.add_row(label, *cells)
        out.print(t)
    out.print("save overhead = C/T (C = time per save, T = interval)"
              + ("; expected overhead = C/T + T/(2·MTBF), save time plus half an interval of work lost per "
                 "failure; Young/Daly T = sqrt(2·C·MTBF)" if mtbf is not None else ""), style="dim")
