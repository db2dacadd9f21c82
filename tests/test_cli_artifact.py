"""``luopan artifact …`` and ``luopan lineage``, and the checkpoint commands that also take artifacts (ls, pin,
prune, du, verify, gc), through the real CLI app."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from luopan.cli.main import app


def run(*args, code=0):
    res = CliRunner().invoke(app, [str(a) for a in args])
    assert res.exit_code == code, (args, res.exit_code, res.output)
    return res.output


def test_artifact_commands_end_to_end(tmp_path):
    repo = tmp_path / "repo"
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.jsonl").write_text('{"x": 1}\n' * 1000)
    (data / "sub" / "b.txt").write_text("b")
    run("init", "-r", repo)
    assert "committed datasets/raw@1" in run("-r", repo, "artifact", "commit", "datasets/raw", data)
    out = json.loads(run("-r", repo, "artifact", "commit", "datasets/clean", data, "--parent", "datasets/raw@1",
                         "--meta", "rows=1000", "--meta", "source=web", "--json"))
    assert out["version"] == 1 and out["parents"] == ["datasets/raw@1"]
    assert out["metadata"] == {"rows": 1000, "source": "web"} and out["stored_bytes"] == 0  # same chunks as raw
    listing = json.loads(run("-r", repo, "artifact", "ls", "--json"))
    assert [a["name"] for a in listing["artifacts"]] == ["datasets/clean", "datasets/raw"]
    files = json.loads(run("-r", repo, "artifact", "ls", "datasets/clean@1", "--json"))["files"]
    assert [f["path"] for f in files] == ["a.jsonl", "sub/b.txt"]
    log = json.loads(run("-r", repo, "artifact", "log", "datasets/clean", "--json"))
    assert [v["parents"] for v in log["versions"]] == [["datasets/raw@1"]]
    assert "versions of datasets/clean" in run("-r", repo, "artifact", "log", "datasets/clean")
    run("-r", repo, "artifact", "checkout", "datasets/clean@1", tmp_path / "out")
    assert (tmp_path / "out" / "sub" / "b.txt").read_text() == "b"
    (tmp_path / "out" / "sub" / "b.txt").write_text("edited")
    run("-r", repo, "artifact", "checkout", "datasets/clean", tmp_path / "out", code=1)  # a local edit: refused
    assert (tmp_path / "out" / "sub" / "b.txt").read_text() == "edited"
    lin = json.loads(run("-r", repo, "lineage", "datasets/clean@1", "--json"))
    assert lin["parents"] == ["datasets/raw@1"]
    assert "-> datasets/clean@1" in run("-r", repo, "lineage", "datasets/raw@1")
    # the checkpoint commands take artifacts too
    assert "datasets/clean" in run("-r", repo, "ls")
    run("-r", repo, "artifact", "commit", "datasets/clean", data)
    run("-r", repo, "pin", "datasets/clean", "1", "--tag", "golden")
    assert json.loads(run("-r", repo, "ls", "datasets/clean", "--json"))["versions"][0]["pinned"] is True
    run("-r", repo, "prune", "datasets/clean", "--keep-last", "1")
    assert json.loads(run("-r", repo, "du", "--json"))["artifacts"] == 3  # 1 is pinned: kept
    run("-r", repo, "unpin", "datasets/clean@1")
    run("-r", repo, "pin", "datasets/clean@1")
    run("-r", repo, "unpin", "datasets/clean", "1")
    out = json.loads(run("-r", repo, "artifact", "prune", "datasets/clean", "--keep-last", "1", "--json"))
    assert out["remove"] == [1]
    run("-r", repo, "gc", "--grace", "0")
    assert "ok" in run("-r", repo, "verify")
    assert "ok" in run("-r", repo, "artifact", "verify", "datasets/clean@2")
    assert "ok" in run("-r", repo, "verify", "datasets/clean")
    assert "ok" in run("-r", repo, "verify", "datasets/clean", "2")
    run("-r", repo, "verify", "datasets/clean@1", code=4)  # pruned


def test_artifact_command_errors(tmp_path):
    repo = tmp_path / "repo"
    run("init", "-r", repo)
    run("-r", repo, "artifact", "log", "nope", code=4)
    run("-r", repo, "artifact", "checkout", "nope@1", tmp_path / "o", code=4)
    run("-r", repo, "lineage", "nope@1", code=4)
    run("-r", repo, "artifact", "commit", "x", tmp_path / "missing", code=4)
    run("-r", repo, "artifact", "commit", "bad name", tmp_path, code=2)  # an invalid name is a usage error
    run("-r", repo, "artifact", "commit", "x", tmp_path, "--meta", "novalue", code=2)
    run("-r", repo, "artifact", "pin", "x", code=2)  # a version is needed
    assert "no artifacts yet" in run("-r", repo, "artifact", "ls")


def test_commit_creates_a_missing_repository_as_luopan_open_does(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("hello")
    fresh = tmp_path / "fresh"
    r = CliRunner().invoke(app, ["artifact", "commit", "-r", str(fresh), "ds", str(tmp_path / "data")])
    assert r.exit_code == 0, r.output
    assert "created a luopan repository" in r.output and "committed ds@1" in r.output
    import luopan

    assert [v.version for v in luopan.open(fresh, create=False).artifact("ds").versions()] == [1]
    for read in (["ls"], ["verify"], ["artifact", "ls"], ["du"]):  # reading a path with no repository: no repository
        r = CliRunner().invoke(app, [*read, "-r", str(tmp_path / "none")])
        assert r.exit_code == 4 and "no luopan repository" in r.output, (read, r.output)
    assert not (tmp_path / "none").exists()


def test_checkout_in_place_status_and_diff(tmp_path):
    """The DVC workflow from the shell: check out, update in place, see what changed, refuse to clobber an edit."""
    repo, data, co = tmp_path / "repo", tmp_path / "data", tmp_path / "co"
    data.mkdir()
    (data / "a.txt").write_text("a1\n")
    (data / "keep.bin").write_bytes(b"k" * 5000)
    (data / "old.txt").write_text("old\n")
    run("-r", repo, "artifact", "commit", "ds", data)  # creates the repository
    (data / "a.txt").write_text("a2, longer\n")
    (data / "old.txt").unlink()
    (data / "new.txt").write_text("new\n")
    run("-r", repo, "artifact", "commit", "ds", data)
    run("-r", repo, "artifact", "checkout", "ds@1", co)
    ino = (co / "keep.bin").stat().st_ino
    assert "checked out ds@2" in run("-r", repo, "artifact", "checkout", "ds@2", co)  # in place
    assert (co / "keep.bin").stat().st_ino == ino and not (co / "old.txt").exists()
    assert (co / "a.txt").read_text() == "a2, longer\n" and (co / "new.txt").read_text() == "new\n"
    assert "clean" in run("-r", repo, "artifact", "status", "ds", co)
    (co / "a.txt").write_text("my edit\n")
    (co / "mine.txt").write_text("mine\n")
    (co / "new.txt").unlink()
    text = run("-r", repo, "artifact", "status", "ds", co, code=1)  # differs: exit 1, as git diff --exit-code
    assert "modified:  a.txt" in text and "added:     mine.txt" in text and "deleted:   new.txt" in text
    st = json.loads(run("-r", repo, "artifact", "status", "ds", co, "--json", code=1))
    assert (st["ref"], st["clean"], st["modified"], st["added"], st["deleted"]) == (
        "ds@2", False, ["a.txt"], ["mine.txt"], ["new.txt"])
    res = CliRunner().invoke(app, ["-r", str(repo), "artifact", "checkout", "ds@1", str(co)])
    assert res.exit_code == 1 and "a.txt" in res.stderr and "--force" in res.stderr, res.output
    assert (co / "a.txt").read_text() == "my edit\n"  # nothing changed
    run("-r", repo, "artifact", "checkout", "ds@1", co, "--force")
    assert (co / "a.txt").read_text() == "a1\n" and (co / "old.txt").exists() and (co / "mine.txt").exists()
    assert json.loads(run("-r", repo, "artifact", "status", "ds@1", co, "--json", code=1))["added"] == ["mine.txt"]
    d = json.loads(run("-r", repo, "artifact", "diff", "ds@1", "ds@2", "--json"))
    assert [(c["path"], c["size_a"], c["size_b"]) for c in d["modified"]] == [("a.txt", 3, 11)]
    assert [c["path"] for c in d["added"]] == ["new.txt"] and [c["path"] for c in d["removed"]] == ["old.txt"]
    assert d["unchanged"] == 1 and d["same"] is False
    text = run("-r", repo, "artifact", "diff", "ds@1", "ds")  # NAME alone: the latest
    assert "ds@1 -> ds@2" in text and "1 added, 1 removed, 1 modified, 1 unchanged" in text
    run("-r", repo, "artifact", "diff", "ds@1", "ds@9", code=4)
    run("-r", repo, "artifact", "diff", "ds@x", "ds@1", code=2)
    run("-r", repo, "artifact", "status", "ds", tmp_path / "nowhere", code=2)  # a usage error, not 1 (differs)


def test_reading_commands_on_a_missing_repository_say_so_and_create_nothing(tmp_path):
    (tmp_path / "co").mkdir()
    none = tmp_path / "none"
    for args in (["checkout", "ds@1", str(tmp_path / "co")], ["status", "ds", str(tmp_path / "co")],
                 ["diff", "ds@1", "ds@2"], ["log", "ds"], ["verify", "ds"], ["pin", "ds@1"], ["unpin", "ds@1"],
                 ["prune", "ds", "--keep-last", "1"], ["ls"]):
        res = CliRunner().invoke(app, ["-r", str(none), "artifact", *args])
        assert res.exit_code == 4 and "no luopan repository" in res.output, (args, res.output)
    assert not none.exists()
