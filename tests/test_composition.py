"""Issue 28: luopan.Repo is a thin composition of the core (Repository) and the kinds' façades; every kind writes
chunks through one chunk writer and commits through one write transaction."""

import ast
import inspect
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import luopan
from luopan.artifact import Artifact
from luopan.checkpoint.api import Checkpoints
from luopan.repository.core import Repository

SRC = Path(__file__).resolve().parents[1] / "src" / "luopan"


def public_methods(cls):
    return sorted(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n))
                  and not isinstance(inspect.getattr_static(cls, n), property))


def test_repo_has_at_most_20_public_methods_each_with_its_real_signature():
    methods = public_methods(luopan.Repo)
    assert len(methods) <= 20, methods
    for name in methods:
        params = inspect.signature(getattr(luopan.Repo, name)).parameters.values()
        assert not any(p.kind is p.VAR_KEYWORD for p in params), f"Repo.{name} hides its keywords behind **"
    save = inspect.signature(luopan.Repo.save).parameters
    for keyword in ("metrics", "metadata", "overwrite", "trust_versions", "touched_rows", "inputs", "progress",
                    "group"):
        assert keyword in save and save[keyword].kind is inspect.Parameter.KEYWORD_ONLY, keyword


def test_repo_is_composed_not_inherited(tmp_path):
    assert luopan.Repo.__mro__ == (luopan.Repo, object)
    repo = luopan.open(tmp_path / "r")
    assert isinstance(repo.repository, Repository) and isinstance(repo.checkpointing, Checkpoints)
    assert repo.checkpointing.repository is repo.repository
    assert not isinstance(repo.checkpointing, Repository)  # the kind is composed with the core, not a subclass
    assert repo.artifact("ds").repo is repo.repository
    repo.close()


def test_step_is_second_and_the_old_order_still_works_with_a_warning(tmp_path):
    repo = luopan.open(tmp_path / "r")
    repo.save("a", 1, {"w": np.arange(4.0)})
    repo.save("a", 2, {"w": np.arange(4.0) + 1})
    target = {"w": np.zeros(4)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        repo.load_into("a", 1, target)
        assert target["w"].tolist() == [0, 1, 2, 3]
        repo.load_into("a", target=target)
        assert target["w"].tolist() == [1, 2, 3, 4]
        repo.load_into("a", np.int64(1), target)  # a NumPy step is a step
        assert target["w"].tolist() == [0, 1, 2, 3]
        out = repo.export("a", 1, tmp_path / "one.safetensors")
        assert out["tensors"] == 1
    with pytest.warns(DeprecationWarning, match="step comes second"):
        repo.load_into("a", target, 2)
    assert target["w"].tolist() == [1, 2, 3, 4]
    with pytest.warns(DeprecationWarning, match="step comes second"):
        repo.export("a", str(tmp_path / "two.safetensors"), 2)
    assert (tmp_path / "two.safetensors").stat().st_size > 0
    with pytest.raises(luopan.ArgumentTypeError, match="needs a target"):
        repo.load_into("a", 1)
    repo.close()


def test_names_that_moved_off_the_repo_still_work_with_a_warning(tmp_path):
    repo = luopan.open(tmp_path / "r")
    repo.save("a", 1, {"w": np.arange(4.0)})
    with pytest.warns(DeprecationWarning, match="repo.checkpointing.strays"):
        assert repo.strays() == repo.checkpointing.strays()
    with pytest.warns(DeprecationWarning, match="repo.repository.lineage"):
        assert repo.lineage("a@1").checkpoints == []
    with pytest.warns(DeprecationWarning):
        with pytest.raises(luopan.LuopanError, match="not a tiered repository"):
            repo.wait_replicated(1)
    with pytest.raises(AttributeError):
        repo.no_such_verb  # noqa: B018
    repo.close()


def test_every_kind_opens_on_the_repository(tmp_path):
    repo = luopan.open(tmp_path / "r")
    art = repo.artifact("ds/a")
    assert isinstance(art, Artifact)
    assert art.commit({"f.txt": b"hello"}).version == 1
    with repo.journal("j") as j:
        j.append({"x": 1})
    assert luopan.artifact.artifact_names(repo) == ["ds/a"]
    assert repo.du()["artifacts"] == 1
    repo.close()


def _calls(tree, name):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)]


def test_one_chunk_pipeline_and_one_commit_sequence():
    """Packs and index files are built only by the chunk writer (and gc, which consolidates index files); a kind
    takes no shared write lock and puts no manifest itself (the transaction does); no module outside the core
    touches the core's private state."""
    builders, kind_locks, kind_puts, private = {}, [], [], []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        tree = ast.parse(text)
        for name in ("PackWriter", "PackChecker", "build_index"):
            if _calls(tree, name):
                builders.setdefault(name, set()).add(rel)
        if rel.startswith(("repository/", "store/")):
            continue
        if re.search(r"\._(intact_packs|known|indexes_seen)\b", text):
            private.append(rel)
        if re.search(r"locked\([^)]*\"shared\"", text):
            kind_locks.append(rel)
        if _calls(tree, "put_if_absent"):
            kind_puts.append(rel)
    assert builders == {"PackWriter": {"repository/chunkwriter.py"},
                        "PackChecker": {"repository/chunkwriter.py", "repository/core.py"},
                        # gc, and reclaim (gc of one deleted checkpoint's packs, §10.3.1) rewrite index files
                        "build_index": {"repository/chunkwriter.py", "repository/gc.py", "repository/reclaim.py"}}
    assert kind_locks == ["index/api.py"]  # rollback moves the current ref, under the lock; it commits no manifest
    assert kind_puts == ["checkpoint/runs/record.py"]  # a run's record (context, never a manifest)
    assert private == []


KINDS = ("checkpoint", "artifact", "journal", "index")


def _imported_modules(path, tree):
    """Absolute names of the modules ``path`` imports with ``from … import`` (relative ones resolved)."""
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                yield ".".join(base + ([node.module] if node.module else [])), node
            else:
                yield node.module or "", node


def test_other_packages_use_a_kind_only_through_its_public_face():
    """Outside a kind's package, nothing imports the kind's modules: only ``luopan.<kind>`` (its façade), and no
    kind imports another kind at all (type-only imports included)."""
    offenders = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).as_posix()
        owner = rel.split("/")[0] if "/" in rel else None
        for module, node in _imported_modules(path, ast.parse(path.read_text())):
            parts = module.split(".")
            if len(parts) < 2 or parts[0] != "luopan" or parts[1] not in KINDS or parts[1] == owner:
                continue
            if owner in KINDS:
                offenders.append(f"{rel}:{node.lineno}: the {owner} kind imports {module}")
            elif len(parts) > 2:
                offenders.append(f"{rel}:{node.lineno}: imports {module} (use luopan.{parts[1]})")
    assert offenders == []


def test_the_transaction_keeps_the_crash_rule(tmp_path):
    """Packs no index file names never outlive their transaction; once indexed, a failure later leaves them to gc
    (another writer may already deduplicate against them), and nothing is learned from a failed transaction."""
    from luopan.artifact import ARTIFACTS_KIND

    repo = luopan.open(tmp_path / "r")
    core = repo.repository

    def packs():
        return [k for k in core.store.list("packs/") if k.endswith(".pack")]

    with core.transaction(ARTIFACTS_KIND, "x", None, what="test") as tx:  # chunks written, never indexed
        chunks = tx.chunks(targets=1)
        chunks.write([(0, memoryview(b"a" * 5000), None, None, None)])
        assert len(packs()) == 1
    assert packs() == [] and chunks.abandoned
    with pytest.raises(RuntimeError, match="after the index"):
        with core.transaction(ARTIFACTS_KIND, "x", None, what="test") as tx:
            chunks = tx.chunks(targets=1)
            chunks.write([(0, memoryview(b"b" * 5000), None, None, None)])
            index = chunks.write_index()
            raise RuntimeError("after the index")
    assert len(packs()) == 1 and core.store.exists(index)
    assert chunks.rows[0][0][0] in core.chunk_index()  # read back from its index file, not learned early
    with pytest.raises(luopan.LuopanError, match="abandoned"):
        chunks.write_index()
    repo.close()
