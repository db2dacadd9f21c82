"""``luopan publish`` and ``luopan pull``: update channels (docs/format.md §15) — a static, signed directory of
patches and full files that any web server can serve, and a device that updates its safetensors file from it."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.text import Text

from ..channel import publish as do_publish
from ..channel import pull as do_pull
from ..repo import Repo
from ..units import parse_duration
from .app import JsonOpt, app, emit_json, err, handles_errors, human, opens_repo, out
from .grammar import LegacyStep, RunRef, checkpoint_ref, renamed, required


@app.command()
@opens_repo
def publish(
    *,
    r: Repo,
    ref: RunRef,
    legacy_step: LegacyStep = None,
    channel_dir: Annotated[Optional[str], typer.Option(
        "--channel-dir", metavar="DIR", show_default=False,
        help="Channel directory to write (created when missing); serve it with any static web server. Required.")]
    = None,
    sign: Annotated[str, typer.Option("--sign", help="Private key file (luopan key gen) that signs the index and "
                                      "the patches; devices trust its .pub.")],
    keep: Annotated[int, typer.Option(help="Make patches from this many of the latest published versions (older "
                                      "devices download the full file).", min=0, max=100)] = 5,
    expires: Annotated[str, typer.Option(help="How long the index stays valid (e.g. 7d, 30d, 12h): devices refuse "
                                         "it after that, so publish (or renew) before then.")] = "30d",
    subtree: Annotated[Optional[str], typer.Option(help="Publish only the tensors under this key path, e.g. model "
                                                   "(as `luopan export --subtree`).")] = None,
    channel_name: Annotated[Optional[str], typer.Option(
        "--channel-name", metavar="NAME", help="The channel's name, fixed at its first publish (default: the "
        "directory's name); a device follows one channel (luopan pull --channel-name).")] = None,
    trusted_keys: Annotated[Optional[str], typer.Option(
        "--trusted-keys", help="Directory of public keys (*.pub) that may have signed the channel's current index, "
        "besides --sign's own: the old key, when moving the channel to a new one.")] = None,
    min_version: Annotated[Optional[int], typer.Option(
        "--min-version", min=1, help="Give the new index at least this version: to publish again into a channel "
        "whose index.json was lost, above every index version devices have seen.")] = None,
    old_channel: Annotated[Optional[str], typer.Option("--channel", hidden=True,
                                                       help="Deprecated: --channel-dir.")] = None,
    old_name: Annotated[Optional[str], typer.Option("--name", hidden=True, help="Deprecated: --channel-name.")]
    = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish checkpoint RUN@STEP (RUN alone: its latest) as the newest version of an update channel (the
    directory --channel-dir): its full safetensors file, a signed patch from each of the last --keep versions to it,
    and a signed index (version = previous + 1, expiring after --expires), written last. Publishing the newest version's content again only renews the index. The
    current index must verify against --sign's key (or --trusted-keys), and every file kept from it is checked."""
    run, step = checkpoint_ref(ref, legacy_step, "publish", quiet=as_json)
    channel = required(renamed(channel_dir, old_channel, "--channel", "--channel-dir", as_json), "--channel-dir DIR")
    name = renamed(channel_name, old_name, "--name", "--channel-name", as_json)
    parse_duration(expires)  # a usage error before any work
    with err.status("publishing") as status:
        info = do_publish(r, run, step, channel, sign_key=sign, keep=keep, expires=expires, subtree=subtree,
                          name=name, trusted_keys=trusted_keys, min_version=min_version,
                          progress=lambda msg: status.update(Text(msg)))
    if as_json:
        emit_json(info)
        return
    if info["refreshed"]:
        out.print(f"renewed channel {info['name']!r} ({info['channel']}): index version {info['index_version']}, "
                  f"still version {info['version']}, expires {info['expires']}", highlight=False, markup=False)
        return
    out.print(f"published {run} as version {info['version']} of channel {info['name']!r} ({info['channel']}); "
              f"index version {info['index_version']}, expires {info['expires']}", highlight=False, markup=False)
    out.print(f"  full   {info['full']['name']} ({human(info['full']['size'])})", highlight=False, markup=False)
    for p in info["patches"]:
        out.print(f"  patch  {p['name']} ({human(p['size'])}) from version {p['from']}", highlight=False,
                  markup=False)
    if info["removed"]:
        out.print(f"  removed {len(info['removed'])} file(s) named by neither this index nor the previous one",
                  highlight=False)


@app.command()
@handles_errors
def pull(
    *,
    url: Annotated[str, typer.Argument(help="The channel: an http(s):// URL of its directory, or a local path.")],
    base: Annotated[Optional[str], typer.Option("--base", help="The safetensors file this device has (omit it to "
                                                "download the full file).")] = None,
    output: Annotated[str, typer.Option("--output", "-o", help="safetensors file to write (appears atomically; may "
                                        "be the --base file itself).")],
    trusted_keys: Annotated[Optional[str], typer.Option(
        "--trusted-keys", envvar="LUOPAN_TRUSTED_KEYS",
        help="Directory of trusted public keys (*.pub): the index must be signed by one.")] = None,
    state: Annotated[Optional[str], typer.Option("--state", help="This device's state file (written after each "
                                                 "update): with it, an index older than one already seen is refused "
                                                 "as a replay, and the base need not be hashed again.")] = None,
    channel_name: Annotated[Optional[str], typer.Option(
        "--channel-name", metavar="NAME", help="The channel's name: an index of another channel is refused, also on "
        "a first pull.")] = None,
    retries: Annotated[int, typer.Option(help="Retry a cut download this many times (each resumes where it "
                                         "stopped).", min=0, max=100)] = 3,
    old_channel: Annotated[Optional[str], typer.Option("--channel", hidden=True,
                                                       help="Deprecated: --channel-name.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Update a device's model file from a channel (luopan publish): check the index's signature, version (against
    --state) and expiry; download the smallest patch from the version the device has, or the full file, resuming a
    cut download (HTTP Range); verify; apply; record the new version in --state."""
    channel = renamed(channel_name, old_channel, "--channel", "--channel-name", as_json)
    if state is None and not as_json:
        err.print("[yellow]note:[/] without --state, a replayed old (but unexpired) index cannot be told from the "
                  "newest one", highlight=False)
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=err, transient=True) as bars:
        tasks: dict[str, Any] = {}

        def show(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bars.add_task("downloading" if phase == "download" else "applying", total=total)
            bars.update(tasks[phase], completed=done, total=total)

        info = do_pull(url, base, output, trusted_keys=trusted_keys, state_file=state, channel=channel,
                       retries=retries, progress=show)
    if as_json:
        emit_json(info)
        return
    if info["up_to_date"]:
        if info["copied"]:
            out.print(f"{base} is already version {info['version']}, the newest (index version "
                      f"{info['index_version']}): copied it to {info['path']}, nothing downloaded", highlight=False,
                      markup=False)
        else:
            out.print(f"{info['path']} is already version {info['version']}, the newest (index version "
                      f"{info['index_version']}): nothing to do", highlight=False, markup=False)
        return
    how = (f"patch from version {info['from_version']}" if info["kind"] == "patch" else "full file")
    resumed = f", resumed after {human(info['resumed_from'])}" if info["resumed_from"] else ""
    out.print(f"updated {info['path']} to version {info['version']} via the {how} ({human(info['size'])}; "
              f"{human(info['downloaded'])} downloaded{resumed})", highlight=False, markup=False)
