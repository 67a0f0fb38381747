"""index/shard.py: an index folder cut into S range shards under the same global ids; merging the
shards' top-k by score gives the single index's top-k (exact shards; IVF shards probing every list),
and each shard holds exactly its own ids' vectors and metadata."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from icr.index.index_folder import load_index_dir
from icr.index.manifest import Manifest
from icr.index.metadata import MetadataStore
from icr.index.shard import check_shards, shard_index, shard_ranges
from icr.index.vector_index import build_index
from tests.index_folders import write_index_folder

N, DIM, K = 997, 16, 25


def _folder(root: Path, factory: str) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((N, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)  # (N, D)
    index = build_index(vectors, DIM, factory, gpu="off")
    folder = write_index_folder(root / factory.replace(",", "-"), index, factory)
    with MetadataStore.create(folder / "metadata.sqlite") as store:
        store.add({"id": i, "source": f"{i}.jpg", "fields": {"n": i}} for i in range(N))
    return folder, vectors


def _top(index: faiss.Index, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    ivf = faiss.extract_index_ivf(index) if "IVF" in type(faiss.downcast_index(index)).__name__ else None
    if ivf is not None:
        ivf.nprobe = ivf.nlist  # every list: exact
    return index.search(queries, k)


def test_ranges_cover_the_ids_once() -> None:
    assert shard_ranges(10, 3) == [(0, 3), (3, 7), (7, 10)]
    with pytest.raises(ValueError, match="--shards must be between 1"):
        shard_ranges(10, 0)


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
@pytest.mark.parametrize("shards", [2, 4])
def test_merged_shards_equal_the_single_index(tmp_path: Path, factory: str, shards: int) -> None:
    folder, vectors = _folder(tmp_path, factory)
    written = shard_index(folder, tmp_path / "shards", shards)
    queries = vectors[:40] + 0.1 * np.random.default_rng(1).standard_normal((40, DIM)).astype(np.float32)
    single_s, single_i = _top(faiss.read_index(str(folder / "index.faiss")), queries, K)

    manifests, lists = [], []
    for w, (lo, hi) in zip(written, shard_ranges(N, shards), strict=True):
        index, manifest, store = load_index_dir(w["folder"])  # hashes and counts checked
        manifests.append(manifest)
        assert manifest.ntotal == N and index.ntotal == hi - lo
        assert manifest.id_range == [lo, hi] and manifest.holes == 0  # the others' ids are not listed
        ids = faiss.vector_to_array(faiss.downcast_index(index).id_map) if factory == "Flat" else None
        if ids is not None:
            assert sorted(ids) == list(range(lo, hi))
        assert [r["fields"]["n"] for r in store.get([lo, hi - 1])] == [lo, hi - 1]
        store.close()
        lists.append(_top(index, queries, K))
    check_shards(manifests)
    scores = np.concatenate([s for s, _ in lists], axis=1)  # (Q, S*K)
    ids = np.concatenate([i for _, i in lists], axis=1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :K]
    merged_s, merged_i = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
    np.testing.assert_allclose(merged_s, single_s, atol=1e-6)
    for q in range(len(queries)):  # the same ids, up to the order of tied scores
        assert set(merged_i[q][merged_s[q] > single_s[q, -1] + 1e-6]) <= set(single_i[q])


@pytest.mark.parametrize("factory", ["Flat", "IVF8,Flat"])
def test_a_shard_lists_only_its_own_holes_and_holds_only_its_own_ids(tmp_path: Path, factory: str) -> None:
    """A source compacted after deletions, cut in two: each shard lists the deleted ids of its own
    range only (not the other shard's ids), and as a live index holds exactly its live ids."""
    from icr.index.live_compact import compact
    from icr.index.live_index import LiveIndex, base_ids

    folder, _ = _folder(tmp_path, factory)
    index, manifest, store = load_index_dir(folder)
    live = LiveIndex(index, store, tmp_path / "state" / "writes.sqlite", "k", base=base_ids(folder, manifest))
    deleted = [5, 600, 900]
    live.delete(deleted, "t")
    compact(live, folder, tmp_path / "compacted")
    live.close()
    store.close()
    written = shard_index(tmp_path / "compacted", tmp_path / "shards", 2)
    for w, (lo, hi) in zip(written, shard_ranges(N, 2), strict=True):
        index, manifest, store = load_index_dir(w["folder"])
        own = [i for i in deleted if lo <= i < hi]
        assert manifest.id_range == [lo, hi] and manifest.holes == len(own)
        shard = LiveIndex(index, store, None, "k", base=base_ids(w["folder"], manifest))
        state = shard.state
        live_ids = [i for i in range(N) if state.is_live(i)]
        assert live_ids == [i for i in range(lo, hi) if i not in own]  # its own, less its holes
        assert state.size == hi - lo - len(own) == index.ntotal and state.deleted == len(own)
        bitmap = np.unpackbits(state.base_alive_bitmap, bitorder="little")[:N]
        assert np.flatnonzero(bitmap).tolist() == live_ids
        store.close()


def test_shards_of_different_builds_are_refused(tmp_path: Path) -> None:
    folder, _ = _folder(tmp_path, "Flat")
    written = shard_index(folder, tmp_path / "shards", 2)
    manifests = [Manifest.read(Path(w["folder"]) / "manifest.json") for w in written]
    with pytest.raises(ValueError, match="expected shards 0..0 of 1"):
        check_shards(manifests[:1])
    other = manifests[1].model_copy(update={"created": "2026-01-01T00:00:00+00:00"})
    with pytest.raises(ValueError, match="different checkpoints or builds"):
        check_shards([manifests[0], other])


def test_icr_index_shard_writes_the_folders(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from icr import cli

    folder, _ = _folder(tmp_path, "IVF8,Flat")
    out = tmp_path / "cut"
    result = CliRunner().invoke(cli.app, ["index", "shard", str(folder), "--shards", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "shard 2: ids 665-996" in result.output
    assert sorted(p.name for p in out.iterdir()) == [f"shard-{s}-of-3" for s in range(3)]
    bad = CliRunner().invoke(cli.app, ["index", "shard", str(folder), "--shards", "0", "--out", str(out)])
    assert bad.exit_code != 0 and "--shards must be between 1" in bad.output


def test_the_cluster_bench_cuts_again_shards_of_another_build_or_format(tmp_path: Path) -> None:
    """bench/cluster.py reuses a previous run's shards only when they are this build's, in the
    current format (a workdir outlives the code that cut them)."""
    from bench.cluster import _cut_already

    folder, _ = _folder(tmp_path, "Flat")
    cut = tmp_path / "shards-2"
    assert not _cut_already(folder, cut, 2)  # nothing cut yet
    shard_index(folder, cut, 2)
    assert _cut_already(folder, cut, 2) and not _cut_already(folder, cut, 3)
    path = cut / "shard-1-of-2" / "manifest.json"
    old = Manifest.read(path)
    path.write_text(old.model_copy(update={"id_range": None, "holes": 0}).to_json())  # before id_range
    assert not _cut_already(folder, cut, 2)
    path.write_text(old.model_copy(update={"created": "2026-01-01T00:00:00+00:00"}).to_json())
    assert not _cut_already(folder, cut, 2)


def test_a_compacted_shard_keeps_its_range_the_last_open_ended(tmp_path: Path) -> None:
    """Compacting a shard folder keeps its id range: the first of one shard (the whole id space),
    a first of two ([0, hi)), and the last, which took an added image, grown to hold it."""
    from icr.index.live_compact import compact
    from icr.index.live_index import LiveIndex, base_ids
    from icr.index.live_writes import NewImage

    folder, vectors = _folder(tmp_path, "Flat")
    for shards in (1, 2):
        for w, (lo, hi) in zip(
            shard_index(folder, tmp_path / f"cut{shards}", shards), shard_ranges(N, shards), strict=True
        ):
            index, manifest, store = load_index_dir(w["folder"])
            log = tmp_path / f"state-{shards}-{lo}" / "writes.sqlite"
            live = LiveIndex(index, store, log, "k", base=base_ids(w["folder"], manifest))
            last = hi == N
            if last:
                live.add([NewImage(vectors[0], {"source": "new", "captions": []})], "t")
            out = tmp_path / f"compacted-{shards}-{lo}"
            compact(live, Path(w["folder"]), out)
            live.close()
            store.close()
            assert Manifest.read(out / "manifest.json").id_range == [lo, N + 1 if last else hi]
