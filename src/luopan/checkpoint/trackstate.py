"""What a save leaves for the next save of the run in this process: each delta-candidate entry's track (its base,
patch and cycle; docs/format.md §5.2, §5.4), once the save's chunks are stored. Part of save._CheckpointWriter."""

from __future__ import annotations

import dataclasses

from ..format.pack import BlobLocation
from .deltaplan import estimated_cycle
from .request import SaveRequest
from .rowdelta import MAX_BACKOFF, Decision, RowTrack
from .writectx import WriteContext


class TrackUpdates:
    """The writer's tracks after its save (a mixin of save._CheckpointWriter, which sets these attributes)."""

    ctx: WriteContext
    req: SaveRequest
    rows: list[list[tuple[str, int, str]]]
    new_locations: dict[str, BlobLocation]
    decisions: dict[int, Decision]
    deltas: dict[int, tuple[int, int, int, int]]
    xors: dict[int, tuple[int, int]]
    segment_chunks: dict[int, list[tuple[int, int, int]]]
    stored_by_target: dict[int, int]
    skipped: set[int]

    def _stored_length(self, t: int) -> int:
        """Stored bytes of a target's chunks, wherever they live (what its content costs in the repository)."""
        return sum((self.new_locations.get(h) or self.ctx.known[h]).length for h in {h for h, _s, _x in self.rows[t]})

    def _track_after(self, i: int) -> RowTrack:
        """Entry ``i``'s track once this save commits."""
        track = self.decisions[i].track
        if i in self.xors:
            cost = self.stored_by_target.get(self.xors[i][1], 0)  # written now (chunks already stored are free)
            size = self._stored_length(self.xors[i][1])  # what the delta takes: the next one's estimate
            track = dataclasses.replace(track, cycle_bytes=track.cycle_bytes + cost,
                                        cycle_saves=track.cycle_saves + 1, xor_bytes=size)
            if size > self.ctx.policy.xor_fraction * self.req.leaves[i].nbytes:  # did not pay: pause XOR deltas
                backoff = min(MAX_BACKOFF, max(1, 2 * track.xor_backoff))
                track = dataclasses.replace(track, xor_skip=backoff, xor_backoff=backoff)
        elif i in self.segment_chunks:  # a row delta: what the next save may keep of its patch
            segments, ix, vx = [], 0, 0
            it, vt = self.deltas[i][2:]
            for n, ni, nv in self.segment_chunks[i]:
                segments.append((n, tuple(self.rows[it][ix : ix + ni]), tuple(self.rows[vt][vx : vx + nv])))
                ix, vx = ix + ni, vx + nv
            track = dataclasses.replace(track, segments=tuple(segments))
        elif i not in self.deltas:  # stored in full: this version is the base for later deltas
            track = dataclasses.replace(track, base_step=self.req.step, base_chunks=self.rows[i], form="full",
                                        cycle_bytes=max(1, self._stored_length(i)), cycle_saves=1, xor_bytes=0)
        return track

    def _cycle(self, i: int) -> list[int]:
        """[bytes written since and including the base, saves] after this save: a writer's hint (§5.4)."""
        if i not in self.decisions:  # reused as it was (trust_versions): its hint stands
            return estimated_cycle(self.ctx.previous[self.req.leaves[i].path])
        t = self._track_after(i)
        return [t.cycle_bytes, t.cycle_saves]

    def tracks(self) -> dict[str, RowTrack]:
        """Delta state of the candidate entries after this save (docs/format.md §5.2, §5.4)."""
        out: dict[str, RowTrack] = {}
        for i, leaf in enumerate(self.req.leaves):
            if i in self.decisions:
                out[leaf.path] = self._track_after(i)
            elif i in self.skipped and leaf.path in self.ctx.tracks:
                out[leaf.path] = self.ctx.tracks[leaf.path]
        return out
