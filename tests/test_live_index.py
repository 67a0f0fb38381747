"""A living index (index/live_writes.py, live_state.py, live_index.py) against a naive oracle: a dict
of the live images, searched by brute force, written to by the same random adds, patches, deletes
and external-id replacements."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from icr.index import live_index as live_index_mod
from icr.index.filters import FilterCache, parse_filter
from icr.index.live_index import LiveIndex
from icr.index.live_state import LiveState, merge
from icr.index.live_writes import NewImage, UnknownImage, Write, WriteLog
from icr.index.metadata import MetadataStore
from icr.index.vector_index import build_index
from tests.index_folders import write_index_folder

DIM, BASE, DEPTH = 16, 300, 25
FIELDS = ["album", "year"]
FILTERS = [{"album": "a"}, {"year": {"gte": 2023}}, {"album": "b", "year": {"lt": 2023}}]


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)  # (n, D)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _fields(rng: np.random.Generator) -> dict[str, Any]:
    return {"album": str(rng.choice(["a", "b"])), "year": int(rng.integers(2021, 2025))}


class Oracle:
    """The live images as a dict, searched and filtered naively."""

    def __init__(self) -> None:
        self.items: dict[int, tuple[np.ndarray, dict[str, Any]]] = {}
        self.external: dict[str, int] = {}

    def matches(self, spec: dict[str, Any], fields: dict[str, Any] | None) -> bool:
        fields = fields or {}
        for name, want in spec.items():
            have = fields.get(name)
            if isinstance(want, dict):
                ops = {"gt": np.greater, "gte": np.greater_equal, "lt": np.less, "lte": np.less_equal}
                if not isinstance(have, int) or not all(ops[op](have, v) for op, v in want.items()):
                    return False
            elif have != want:
                return False
        return True

    def top(self, query: np.ndarray, depth: int, spec: dict[str, Any] | None = None) -> list[int]:
        chosen = [(float(v @ query[0]), i) for i, (v, row) in self.items.items()
                  if spec is None or self.matches(spec, row.get("fields"))]  # fmt: skip
        chosen.sort(key=lambda t: (-t[0], t[1]))
        return [i for _, i in chosen[:depth]]


@pytest.fixture()
def base(tmp_path: Path) -> tuple[Any, MetadataStore, Oracle, np.random.Generator]:
    rng = np.random.default_rng(0)
    vectors = _unit(rng, BASE)
    index = build_index(vectors, DIM, "Flat", gpu="off")
    oracle = Oracle()
    store = MetadataStore.create(tmp_path / "metadata.sqlite")
    rows = [{"id": i, "source": f"photo{i}.jpg", "fields": _fields(rng)} for i in range(BASE)]
    store.add(rows)
    store.close()
    for i, row in enumerate(rows):
        oracle.items[i] = (vectors[i], {k: v for k, v in row.items() if k != "id"})
    return index, MetadataStore.open(tmp_path / "metadata.sqlite"), oracle, rng


def _open(tmp_path: Path, index: Any, metadata: MetadataStore) -> LiveIndex:
    return LiveIndex(index, metadata, tmp_path / "state" / "writes.sqlite", "key-1")


def _random_writes(live: LiveIndex, oracle: Oracle, rng: np.random.Generator, rounds: int) -> None:
    """Adds (some naming an external id again, which replaces its image), patches, deletes."""
    for step in range(rounds):
        kind = rng.choice(["add", "add", "patch", "delete"])
        if kind == "add":
            images = []
            for vector in _unit(rng, int(rng.integers(1, 4))):
                external = f"ext-{int(rng.integers(0, 12))}" if rng.random() < 0.5 else None
                if external is not None and any(im.external_id == external for im in images):
                    external = None
                images.append(
                    NewImage(vector, {"source": f"new{step}.jpg", "fields": _fields(rng)}, external)
                )
            for image, ack in zip(images, live.add(images, "tester"), strict=True):
                if ack.replaced is not None:
                    assert oracle.external[image.external_id] == ack.replaced
                    del oracle.items[ack.replaced]
                oracle.items[ack.id] = (image.vector, dict(image.row))
                if image.external_id is not None:
                    oracle.external[image.external_id] = ack.id
        elif kind == "patch":
            target = int(rng.choice(list(oracle.items)))
            change = {"year": int(rng.integers(2021, 2025))} if rng.random() < 0.7 else {"album": None}
            live.patch(target, change, "tester")
            fields = {**(oracle.items[target][1].get("fields") or {}), **change}
            oracle.items[target][1]["fields"] = {k: v for k, v in fields.items() if v is not None} or None
        else:
            targets = [int(t) for t in rng.choice(list(oracle.items), size=3, replace=False)]
            acks = live.delete([*targets, targets[0], 10**9], "tester")  # a repeat and an unknown id: no ack
            assert sorted(a.id for a in acks) == sorted(targets)
            for t in targets:
                del oracle.items[t]
                oracle.external = {k: v for k, v in oracle.external.items() if v != t}


def _check(live: LiveIndex, oracle: Oracle, rng: np.random.Generator, state: LiveState | None = None) -> None:
    state = state or live.state
    assert state.size == len(oracle.items)
    cache = FilterCache(live.metadata, state.base_ntotal, live=live)
    for query in _unit(rng, 4):
        q = query[None, :]  # (1, D)
        scores, ids = live.search(q, DEPTH, state)
        assert list(ids) == oracle.top(q, DEPTH)
        np.testing.assert_allclose(scores, [oracle.items[int(i)][0] @ query for i in ids], atol=1e-5)
        for spec in FILTERS:
            selection, _ = cache.select(parse_filter(spec, FIELDS), state)
            assert len(selection.ids) == len(oracle.top(q, 10**6, spec))  # matched, exactly
            assert list(live.search(q, DEPTH, state, selection)[1]) == oracle.top(q, DEPTH, spec)
    some = [int(i) for i in rng.choice(list(oracle.items), size=20, replace=False)]
    for i, row in zip(some, live.rows(some, state), strict=True):
        assert row["source"] == oracle.items[i][1]["source"] and row["fields"] == oracle.items[i][1]["fields"]


def _reranked(oracle: Oracle) -> Any:
    """The base as fast-scan codes re-ranked from the raw vectors (index/rerank.py), probing every
    list and re-ranking every vector (1,280 candidates > 300): exact, so the oracle's order holds."""
    from icr.index.rerank import RerankedIndex

    vectors = np.stack([oracle.items[i][0] for i in range(BASE)])  # (N, D)
    codes = build_index(vectors, DIM, "IVF8,PQ8x4fs,RFlat", gpu="off")
    codes.nprobe = 8
    return RerankedIndex(codes, vectors)


@pytest.mark.parametrize("reranked", [False, True])
@pytest.mark.parametrize("overfetch", [live_index_mod.OVERFETCH_LIMIT, 0])  # deeper search; a selector
def test_search_filters_and_rows_equal_the_oracle_through_random_writes(
    tmp_path, base, overfetch, reranked, monkeypatch
):
    monkeypatch.setattr(live_index_mod, "OVERFETCH_LIMIT", overfetch)
    index, metadata, oracle, rng = base
    if reranked:
        index = _reranked(oracle)
    live = _open(tmp_path, index, metadata)
    _check(live, oracle, rng)  # nothing written yet: the base alone
    for _ in range(6):
        _random_writes(live, oracle, rng, 15)
        _check(live, oracle, rng)
    assert index.ntotal == BASE  # the base index is never modified


def test_a_state_is_a_snapshot_and_a_reopened_log_replays_to_the_same_state(tmp_path, base):
    index, metadata, oracle, rng = base
    live = _open(tmp_path, index, metadata)
    _random_writes(live, oracle, rng, 40)
    before = live.state
    frozen = Oracle()
    frozen.items = {
        i: (v, {**row, "fields": dict(row["fields"] or {}) or None}) for i, (v, row) in oracle.items.items()
    }
    _random_writes(live, oracle, rng, 40)  # later writes: the old state does not see them
    _check(live, frozen, np.random.default_rng(1), before)
    _check(live, oracle, np.random.default_rng(1))

    live.log.close()
    again = _open(tmp_path, index, metadata)  # a restart: the log replayed from the file
    assert again.state.seq == live.state.seq
    np.testing.assert_array_equal(again.state.ids, live.state.ids)
    np.testing.assert_array_equal(again.state.base_dead, live.state.base_dead)
    _check(again, oracle, np.random.default_rng(2))


def test_writes_from_another_log_handle_appear_on_refresh(tmp_path, base):
    """Two servers on one state directory: each applies what the other wrote when it refreshes."""
    index, metadata, oracle, rng = base
    first, second = _open(tmp_path, index, metadata), _open(tmp_path, index, metadata)
    assert first.log is None and not (tmp_path / "state").exists()  # no write yet: no file
    [ack] = first.add([NewImage(_unit(rng, 1)[0], {"source": "x.jpg"}, "shared")], "one")
    assert not second.state.is_live(ack.id) and second.refresh().is_live(ack.id)
    second.delete([ack.id], "two")
    assert first.state.is_live(ack.id) and not first.refresh().is_live(ack.id)


def _add_many(path: str, prefix: str, count: int) -> None:
    """A child process adding ``count`` images one write at a time."""
    metadata = MetadataStore.open(Path(path) / "metadata.sqlite")
    log = WriteLog(Path(path) / "state" / "writes.sqlite", "key-1", metadata, BASE, DIM)
    rng = np.random.default_rng(abs(hash(prefix)) % 2**32)
    for k, vector in enumerate(_unit(rng, count)):
        log.add([NewImage(vector, {"source": f"{prefix}{k}.jpg"}, f"{prefix}{k}")], prefix)


def test_concurrent_writers_in_two_processes_get_distinct_ids(tmp_path, base):
    index, metadata, _, rng = base
    _open(tmp_path, index, metadata).add([NewImage(_unit(rng, 1)[0], {"source": "first.jpg"})], "t")
    ctx = multiprocessing.get_context("spawn")
    children = [ctx.Process(target=_add_many, args=(str(tmp_path), p, 60)) for p in ("p", "q")]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        assert child.exitcode == 0
    live = _open(tmp_path, index, metadata)
    assert list(live.state.ids) == list(range(BASE, BASE + 121))
    names = sorted(row["source"] for row in live.rows(list(live.state.ids[1:]), live.state))
    assert names == sorted(f"{p}{k}.jpg" for p in ("p", "q") for k in range(60))


def test_bad_writes_are_refused_and_change_nothing(tmp_path, base):
    index, metadata, _, rng = base
    live = _open(tmp_path, index, metadata)
    good = NewImage(_unit(rng, 1)[0], {"source": "ok.jpg"})
    with pytest.raises(ValueError, match=r"shape \(8,\), this index holds \(16,\)"):
        live.add([good, NewImage(np.ones(8, np.float32), {"source": "short.jpg"})], "t")
    with pytest.raises(ValueError, match="external_id: each may appear once"):
        live.add(
            [NewImage(good.vector, {"source": "a"}, "x"), NewImage(good.vector, {"source": "b"}, "x")], "t"
        )
    with pytest.raises(ValueError, match="metadata row"):
        live.add([NewImage(good.vector, {"source": "a", "colour": "red"})], "t")  # not a metadata column
    with pytest.raises(UnknownImage, match="no live image 99999"):
        live.patch(99_999, {"year": 2020}, "t")
    assert live.log.last_seq() == 0 and live.state.size == BASE
    with sqlite3.connect(tmp_path / "state" / "writes.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM writes").fetchone()[0] == 0
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_merge_and_apply_edge_cases() -> None:
    scores, ids = merge(
        3, (np.array([0.9, 0.5], np.float32), np.array([4, 2])), (np.array([0.9, 0.7]), np.array([1, 8]))
    )
    assert list(ids) == [1, 4, 8] and list(scores) == pytest.approx([0.9, 0.9, 0.7])
    state = LiveState.empty(10, 2)
    one = state.apply([Write(1, "add", 10, np.array([1, 0], np.float32))])
    # a second state derived from the same one does not overwrite what the first branch reads
    other = state.apply([Write(1, "add", 10, np.array([0, 1], np.float32))])
    assert one.vectors[0].tolist() == [1, 0] and other.vectors[0].tolist() == [0, 1]
    with pytest.raises(ValueError, match="already applied"):
        one.apply([Write(1, "delete", 10, None)])
    gone = one.apply([Write(2, "delete", 10, None), Write(3, "delete", 3, None)])
    assert not gone.is_live(10) and not gone.is_live(3) and one.is_live(10) and gone.size == 9


def test_a_snapshot_holds_the_state_it_was_taken_at_and_links_the_build(tmp_path, base):
    import faiss

    from icr.index.live_snapshot import SNAPSHOT_FILE, snapshot_log, write_snapshot

    index, metadata, oracle, rng = base
    folder = tmp_path / "built"  # an index folder: what a snapshot links, never copies
    folder.mkdir()
    faiss.write_index(index, str(folder / "index.faiss"))
    (folder / "manifest.json").write_text("{}")
    live = _open(tmp_path, index, metadata)
    _random_writes(live, oracle, rng, 40)
    frozen = Oracle()
    frozen.items = {
        i: (v, {**row, "fields": dict(row["fields"] or {}) or None}) for i, (v, row) in oracle.items.items()
    }
    taken = write_snapshot(live, folder, tmp_path / "snaps" / "one")
    _random_writes(live, oracle, rng, 20)  # after it: not in it

    snap = tmp_path / "snaps" / "one"
    assert 0 < taken["seq"] < live.state.seq
    assert taken["images"] == len(frozen.items) and taken["files_linked"] == 2 and taken["files_copied"] == 0
    assert (snap / "index.faiss").stat().st_ino == (folder / "index.faiss").stat().st_ino
    assert snapshot_log(snap) == snap / "writes.sqlite" and snapshot_log(folder) is None
    with sqlite3.connect(snap / "writes.sqlite") as db:
        held = db.execute("SELECT MAX(seq), COUNT(*) FROM writes").fetchone()
    assert held == (taken["seq"], taken["writes"])
    assert not (snap / "writes.sqlite-wal").exists() and (snap / SNAPSHOT_FILE).is_file()
    restored = LiveIndex(index, metadata, snapshot_log(snap), "key-1", writable=False)
    assert restored.state.seq == taken["seq"] and not restored.writable
    _check(restored, frozen, np.random.default_rng(3))
    with pytest.raises(ValueError, match="takes no writes"):
        restored.delete([0], "tester")
    with pytest.raises(FileExistsError, match="choose another name"):
        write_snapshot(live, folder, snap)
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["one"]  # nothing half-written


def _folder(tmp_path: Path, index: Any, factory: str) -> Path:
    """An index folder (index.faiss, metadata.sqlite, manifest.json) of the ``base`` fixture's index."""
    folder = write_index_folder(tmp_path / "built", index, factory)
    (folder / "metadata.sqlite").hardlink_to(tmp_path / "metadata.sqlite")
    (folder / "calibration.json").write_text("{}")
    return folder


@pytest.mark.parametrize(
    "factory",
    ["Flat", "IVF8,Flat", "IVF8,Flat retrained", "IVF8,PQ8x4fs,RFlat", "IVF8,PQ8x4fs,RFlat retrained"],
)
def test_a_compacted_folder_serves_the_same_images_under_the_same_ids(tmp_path, base, factory, monkeypatch):
    """index/live_compact.py: the folder written from a living index, loaded with the same log, is
    the oracle's state (search, filters, rows); later writes apply over it and ids keep growing."""
    from icr.index import live_compact
    from icr.index.index_folder import load_index_dir
    from icr.index.live_index import base_ids
    from icr.index.vector_index import stored_vectors

    index, metadata, oracle, rng = base
    if factory.startswith("IVF8,PQ"):
        index = _reranked(oracle)
    elif factory != "Flat":
        vectors = np.stack([oracle.items[i][0] for i in range(BASE)])
        index = build_index(vectors, DIM, "IVF8,Flat", gpu="off")
        index.nprobe = 8  # every list: exact, so the oracle's order holds
    if factory.endswith("retrained"):
        monkeypatch.setattr(live_compact, "RETRAIN_IMBALANCE", 0.0)  # any imbalance: train again
    folder = _folder(tmp_path, index, factory.split()[0])
    live = _open(tmp_path, index, metadata)
    _random_writes(live, oracle, rng, 60)
    ids_end = live.state.ids_end
    report = live_compact.compact(live, folder, folder)  # in place, as the server does
    assert report["retrained"] == factory.endswith("retrained") and report["seq"] == live.state.seq
    assert report["vectors"] == len(oracle.items) and report["holes"] == ids_end - len(oracle.items)

    compacted, manifest, store = load_index_dir(folder)  # hashes and counts checked
    assert (
        manifest.ntotal == ids_end
        and manifest.base_seq == report["seq"]
        and compacted.ntotal == len(oracle.items)
    )
    assert (folder / "calibration.json").read_text() == "{}"
    if factory != "Flat":
        faiss_ivf = __import__("faiss").extract_index_ivf(getattr(compacted, "codes", compacted))
        faiss_ivf.nprobe = faiss_ivf.nlist
    again = LiveIndex(
        compacted, store, tmp_path / "state" / "writes.sqlite", "key-1", base=base_ids(folder, manifest)
    )
    assert again.state.seq == report["seq"] and again.state.size == len(oracle.items)
    assert again.state.dead_in_base_index == 0  # the deleted vectors are gone, not skipped
    read = stored_vectors(compacted)  # by id, holes and all (the service's exact rescoring reads them)
    assert read is not None
    some = sorted(oracle.items)[::7]
    np.testing.assert_allclose(read(np.array(some)), np.stack([oracle.items[i][0] for i in some]), atol=1e-6)
    _check(again, oracle, np.random.default_rng(5))
    _random_writes(again, oracle, rng, 30)  # writes after compaction: over the compacted base
    _check(again, oracle, np.random.default_rng(6))
    assert min(a.id for a in again.add([NewImage(_unit(rng, 1)[0], {"source": "n.jpg"})], "t")) >= ids_end


def test_a_compacted_folder_refuses_a_log_that_lacks_its_writes(tmp_path, base):
    """Served with another state directory's log, a compacted folder's later writes would be numbered
    anew and skipped: it refuses to load, naming the fix. With no log (writes off) it is served as is."""
    from icr.index import live_compact
    from icr.index.index_folder import load_index_dir
    from icr.index.live_index import base_ids

    index, metadata, oracle, rng = base
    folder = _folder(tmp_path, index, "Flat")
    live = _open(tmp_path, index, metadata)
    _random_writes(live, oracle, rng, 10)
    live_compact.compact(live, folder, folder)
    compacted, manifest, store = load_index_dir(folder)
    with pytest.raises(ValueError, match="serve it with the state directory it was compacted with"):
        LiveIndex(
            compacted, store, tmp_path / "other" / "writes.sqlite", "key-1", base=base_ids(folder, manifest)
        )
    alone = LiveIndex(
        compacted, store, None, "key-1", base=base_ids(folder, manifest)
    )  # writes off: as it is
    _check(alone, oracle, np.random.default_rng(8))
