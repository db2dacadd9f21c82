"""Repo.delete of a run's newest checkpoint moves the run's latest ref to the newest one left (or removes it with
the last one), so the ref never names a checkpoint that is gone (`luopan check` would report it as damage)."""

import numpy as np
import pytest

import luopan
from luopan.checkpoint.checking import check
from luopan.format.names import latest_ref_key


@pytest.fixture
def repo(tmp_path):
    r = luopan.open(tmp_path / "repo")
    yield r
    r.close()


def test_deleting_the_newest_moves_the_ref_and_the_last_removes_it(repo):
    for s in (1, 2, 3):
        repo.save("a", s, {"w": np.full(4, s)})
    assert repo.delete("a", 3) is True
    assert check(repo).problems == []
    assert repo.manifest("a").step == 2  # the newest left
    assert int(repo.load("a")["w"][0]) == 2
    assert repo.delete("a", 1) is True  # not the newest: the ref stays on 2
    assert repo.manifest("a").step == 2 and check(repo).problems == []
    assert repo.delete("a", 2) is True
    assert not repo.store.exists(latest_ref_key("a"))
    assert check(repo).problems == []
    assert repo.delete("a", 2) is False
