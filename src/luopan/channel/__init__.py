"""Update channels (docs/format.md §15): publish checkpoints as a static, signed channel directory that any web
server can serve, and pull the newest version onto a device that has only a safetensors file.

    import luopan.channel
    luopan.channel.publish(repo, "run-a", 300, "site/stable", sign_key="keys/luopan.key", keep=5, expires="30d")
    luopan.channel.pull("https://example.org/stable", "model.safetensors", "model.safetensors",
                        trusted_keys="trusted/", state_file="channel-state.json")

A pull downloads the smallest patch from the version the device has (luopan.patch) or the full file, resumes a cut
download with HTTP Range requests, and refuses an index that is unsigned, signed by an unknown key, tampered with,
older than one the device has seen (rollback) or past its expiry (freeze). The repository core never imports this
package, and ``pull`` imports no repository: ``publish``, which reads one, is loaded on first use
(luopan.channel.publishing).
"""

from __future__ import annotations

from .._lazy import lazy_names
from .index import ChannelIndex, ChannelVersion, FileRef, PatchRef, parse_index
from .pull import pull
from .state import DeviceState, read_state


# ``luopan.channel.publish`` on first use (it imports the repository)
__getattr__, __dir__ = lazy_names(__name__, {"publish": ".publishing"})

__all__ = ["ChannelIndex", "ChannelVersion", "DeviceState", "FileRef", "PatchRef", "parse_index", "publish", "pull",
           "read_state"]
