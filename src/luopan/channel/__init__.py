"""Update channels (docs/format.md §15): publish checkpoints as a static, signed channel directory that any web
server can serve, and pull the newest version onto a device that has only a safetensors file.

    import luopan.channel
    luopan.channel.publish(repo, "run-a", 300, "site/stable", sign_key="keys/luopan.key", keep=5, expires="30d")
    luopan.channel.pull("https://example.org/stable", "model.safetensors", "model.safetensors",
                        trusted_keys="trusted/", state_file="channel-state.json")

A pull downloads the smallest patch from the version the device has (luopan.patch) or the full file, resumes a cut
download with HTTP Range requests, and refuses an index that is unsigned, signed by an unknown key, tampered with,
older than one the device has seen (rollback) or past its expiry (freeze). The repository core never imports this
package.
"""

from __future__ import annotations

from .index import ChannelIndex, ChannelVersion, FileRef, PatchRef, parse_index
from .publish import publish
from .pull import pull
from .state import DeviceState, read_state

__all__ = ["ChannelIndex", "ChannelVersion", "DeviceState", "FileRef", "PatchRef", "parse_index", "publish", "pull",
           "read_state"]
