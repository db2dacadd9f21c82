"""``luopan publish`` against a hostile neighbour (issue 27 item 7): links planted where publish makes its scratch
space, its lock or its served directories are never followed (nothing outside the channel is deleted or created),
and the bytes the signed index lists are the bytes luopan wrote, even when the scratch path is swapped between the
write and the fingerprint."""

from __future__ import annotations

import importlib
import os

import blake3
import numpy as np
import pytest

import luopan
from luopan.channel import parse_index, publish
from luopan.signing import generate_key, load_signing_key

publish_module = importlib.import_module("luopan.channel.publishing")
CHUNK = 64 << 10


@pytest.fixture
def env(tmp_path):
    generate_key(tmp_path / "keys", "release")
    key = load_signing_key(tmp_path / "keys" / "release.key")
    repo = luopan.open(tmp_path / "repo", chunk_size=CHUNK)
    rng = np.random.default_rng(7)
    state = {"model": {"w": rng.standard_normal((64, 1024), dtype=np.float32)}}
    repo.save("run-a", 1, state)
    state["model"]["w"][:4] += 1.0
    repo.save("run-a", 2, state)
    (tmp_path / "site").mkdir()
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    for name in ("precious.txt", "sub/also.txt"):
        (victim / name).write_text("keep me")
    yield tmp_path, repo, key, victim
    repo.close()


def victim_intact(victim) -> bool:
    return (victim / "precious.txt").read_text() == "keep me" and (victim / "sub" / "also.txt").exists()


def test_planted_scratch_links_are_not_followed_and_nothing_is_deleted(env):
    tmp_path, repo, key, victim = env
    chan = tmp_path / "site" / "stable"
    chan.mkdir()
    os.symlink(victim, tmp_path / "site" / ".stable.publish-tmp")  # both places publish may use are links
    os.symlink(victim, chan / ".tmp")
    with pytest.raises(luopan.UsageError, match="scratch"):
        publish(repo, "run-a", 1, chan, sign_key=key, subtree="model")
    assert victim_intact(victim) and sorted(os.listdir(victim)) == ["precious.txt", "sub"]
    assert not (chan / "index.json").exists()


@pytest.mark.parametrize("planted", [".stable.publish-tmp", "stable/.tmp"])
def test_one_planted_link_is_passed_over_and_its_target_untouched(env, planted):
    tmp_path, repo, key, victim = env
    chan = tmp_path / "site" / "stable"
    chan.mkdir()
    os.symlink(victim, tmp_path / "site" / planted)
    publish(repo, "run-a", 1, chan, sign_key=key, subtree="model")
    publish(repo, "run-a", 2, chan, sign_key=key, subtree="model")
    assert victim_intact(victim) and sorted(os.listdir(victim)) == ["precious.txt", "sub"]
    assert parse_index((chan / "index.json").read_bytes()).version == 2
    assert os.path.islink(tmp_path / "site" / planted)  # left as it was, not emptied or removed


def test_leftovers_in_the_scratch_container_are_removed_without_following_links(env):
    tmp_path, repo, key, victim = env
    chan = tmp_path / "site" / "stable"
    container = tmp_path / "site" / ".stable.publish-tmp"
    (container / "publish-0123").mkdir(parents=True)
    os.symlink(victim, container / "publish-0123" / "link")
    os.symlink(victim, container / "link")
    (container / "full.safetensors").write_bytes(b"old leftover")
    publish(repo, "run-a", 1, chan, sign_key=key, subtree="model")
    assert os.listdir(container) == [] and victim_intact(victim)


@pytest.mark.parametrize("folder", ["full", "patches"])
def test_a_served_directory_that_is_a_link_is_refused(env, folder):
    tmp_path, repo, key, victim = env
    chan = tmp_path / "site" / "stable"
    chan.mkdir()
    os.symlink(victim, chan / folder)
    with pytest.raises(luopan.UsageError, match="symbolic link"):
        publish(repo, "run-a", 1, chan, sign_key=key, subtree="model")
    assert victim_intact(victim) and sorted(os.listdir(victim)) == ["precious.txt", "sub"]


def test_a_lock_file_that_is_a_link_is_not_followed(env):
    tmp_path, repo, key, _victim = env
    chan = tmp_path / "site" / "stable"
    chan.mkdir()
    os.symlink(tmp_path / "created-through-the-link", chan / ".publish.lock")
    with pytest.raises(luopan.LuopanError):
        publish(repo, "run-a", 1, chan, sign_key=key, subtree="model")
    assert not (tmp_path / "created-through-the-link").exists()


def swap_after(write, rogue: bytes, moved: list[str]):
    """A writer wrapped so that, as soon as it returns, a neighbour swaps the directory it wrote into: moves it
    away and puts a link in its place to a directory of theirs holding ``rogue`` under the same name."""
    def wrapper(*args, **kwargs):
        out = write(*args, **kwargs)
        path = next(str(a) for a in args if isinstance(a, (str, os.PathLike)) and
                    str(a).endswith((".safetensors", ".lpatch")))
        d, name = os.path.split(path)
        evil = d + ".evil"
        os.mkdir(evil)
        with open(os.path.join(evil, name), "wb") as f:
            f.write(rogue)
        os.rename(d, d + ".moved")
        os.symlink(evil, d)
        moved.append(d)
        return out
    return wrapper


@pytest.mark.parametrize("which", ["export", "patch"])
def test_the_index_signs_the_bytes_luopan_wrote_even_when_the_scratch_path_is_swapped(env, monkeypatch, which):
    tmp_path, repo, key, _victim = env
    chan = tmp_path / "site" / "stable"
    publish(repo, "run-a", 1, chan, sign_key=key, subtree="model")
    rogue_model = tmp_path / "rogue.safetensors"
    repo.save("rogue", 1, {"model": {"w": np.zeros((64, 1024), dtype=np.float32)}})
    repo.export("rogue", rogue_model, 1, subtree="model")
    genuine = tmp_path / "genuine.safetensors"
    repo.export("run-a", genuine, 2, subtree="model")
    moved: list[str] = []
    if which == "export":
        monkeypatch.setattr(type(repo), "export", swap_after(type(repo).export, rogue_model.read_bytes(), moved))
    else:
        monkeypatch.setattr(publish_module, "create",
                            swap_after(publish_module.create, b"LPATCH rogue bytes", moved))
    try:
        publish(repo, "run-a", 2, chan, sign_key=key, subtree="model")
    except luopan.IntegrityError:
        pass  # refusing is fine too; signing the rogue bytes is not
    assert moved, "the swap never happened"
    idx = parse_index((chan / "index.json").read_bytes())
    for ref in idx.files():
        data = (chan / ref.name).read_bytes()
        assert ref.size == len(data) and ref.blake3 == blake3.blake3(data).hexdigest()
        assert data not in (rogue_model.read_bytes(), b"LPATCH rogue bytes")
    if idx.version == 2:
        assert (chan / idx.latest.full.name).read_bytes() == genuine.read_bytes()
        assert luopan.patch.fingerprint_file(genuine, CHUNK) == idx.latest.fingerprint
