"""Indices larger than memory: the on-disk IVF build (sample-trained, shard by shard, inverted lists merged
on disk) against an in-memory twin and brute force, the factory the budget picks, and an index folder
built with --on-disk, loaded memory-mapped and searched by the service's code."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from icr.index.build import build_photo_index
from icr.index.index_folder import load_index_dir
from icr.index.on_disk import (
    KMEANS_ITERATIONS,
    ONDISK_DATA,
    OPQ_ITERATIONS,
    build_on_disk,
    choose_on_disk_factory,
    load_on_disk,
)
from icr.index.vector_index import search, set_nprobe, stored_vectors


def _unit(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _chunks(x: np.ndarray, size: int = 997):
    for lo in range(0, len(x), size):
        yield x[lo : lo + size]


@pytest.mark.parametrize("factory", ["IVF32,Flat", "IVF32_HNSW32,Flat", "IVF32,PQ8", "OPQ8,IVF32,PQ8"])
def test_on_disk_build_equals_its_in_memory_twin(tmp_path, factory):
    import faiss

    x = _unit(12_000, 32, 0)
    seen = []
    build = build_on_disk(
        _chunks(x), 32, factory, tmp_path, "index.faiss",
        memory_budget_bytes=64 << 20, shard_size=2_500, workers=2, on_vectors=seen.append,
    )  # fmt: skip
    assert build.ntotal == 12_000 and build.shards == 5 and build.train_points == 10_000
    assert np.array_equal(np.concatenate(seen), x)  # every vector passed the observer, in order
    assert (tmp_path / ONDISK_DATA).is_file() and not (tmp_path / ".blocks").exists()
    index = load_on_disk(tmp_path / "index.faiss")
    # the twin: the same factory trained on the same first 10,000 vectors, filled in memory
    twin = faiss.index_factory(32, factory, faiss.METRIC_INNER_PRODUCT)
    ivf = faiss.downcast_index(faiss.extract_index_ivf(twin))
    ivf.cp.niter = KMEANS_ITERATIONS
    if hasattr(ivf, "do_polysemous_training"):
        ivf.do_polysemous_training = False
    if isinstance(twin, faiss.IndexPreTransform):
        faiss.downcast_VectorTransform(twin.chain.at(0)).niter = OPQ_ITERATIONS
    twin.train(x[:10_000])
    twin.add(x)
    queries = _unit(20, 32, 1)
    for nprobe in (4, 32):
        set_nprobe(index, nprobe)
        set_nprobe(twin, nprobe)
        got_s, got_i = search(index, queries, 10)
        want_s, want_i = search(twin, queries, 10)
        for a, b, sa, sb in zip(got_i, want_i, got_s, want_s, strict=True):
            assert a.tolist() == b.tolist()
            np.testing.assert_allclose(sa, sb, atol=1e-5)
    if factory.endswith(",Flat"):  # every list probed: exact, equal to brute force
        truth = np.argsort(-(queries @ x.T), axis=1, kind="stable")[:, :10]
        assert [r.tolist() for r in got_i] == truth.tolist()
    # stored vectors read back by id from the lists on disk (a search from a stored image)
    read = stored_vectors(index)
    assert read is not None
    ids = np.array([0, 6_000, 11_999, 6_000])
    if factory.endswith(",Flat"):
        np.testing.assert_allclose(read(ids), x[ids], atol=1e-6)
    else:  # decoded from PQ codes: near the vector that was added, not equal
        cosines = np.sum(read(ids) * x[ids], axis=1) / np.linalg.norm(read(ids), axis=1)
        assert np.all(cosines > 0.7) and np.abs(read(ids) - x[ids]).max() > 1e-6


def test_the_budget_picks_the_codes():
    gib = 1 << 30
    assert choose_on_disk_factory(1_000_000, 256, 4 * gib)[0] == "IVF4000,Flat"  # 0.96 GiB of floats + ids
    factory, reason = choose_on_disk_factory(10_000_000, 256, 4 * gib)
    assert factory == "IVF12649_HNSW32,PQ64,RFlat" and "16x smaller" in reason and "HNSW" in reason
    assert "re-ranked exactly from the raw vectors on disk" in reason
    assert choose_on_disk_factory(10_000_000, 256, 1 * gib)[0] == "OPQ16,IVF12649_HNSW32,PQ16,RFlat"
    capped = "OPQ4,IVF65536_HNSW32,PQ4,RFlat"  # nlist capped
    assert choose_on_disk_factory(3 * 10**8, 256, 16 * gib)[0] == capped
    with pytest.raises(ValueError, match="raise --memory-budget-mb"):
        choose_on_disk_factory(10**9, 256, 1 * gib)


def test_on_disk_codes_are_re_ranked_from_the_raw_vectors_on_disk(tmp_path):
    from icr.index.rerank import RAW_FILE, Rerank, RerankedIndex, load_raw

    x = _unit(12_000, 32, 0)
    build_on_disk(
        _chunks(x), 32, "IVF32,PQ8,RFlat", tmp_path, "index.faiss",
        memory_budget_bytes=64 << 20, shard_size=2_500, workers=2,
    )  # fmt: skip
    assert np.array_equal(np.fromfile(tmp_path / RAW_FILE, np.float32).reshape(-1, 32), x)  # in id order
    codes = load_on_disk(tmp_path / "index.faiss")
    raw = load_raw(tmp_path / RAW_FILE, len(x), 32, mmap=True)
    queries = _unit(30, 32, 1)
    exact = queries @ x.T  # (30, 12000)
    truth = np.argsort(-exact, axis=1, kind="stable")[:, :10]
    set_nprobe(codes, 32)  # every list
    # every vector a candidate: the exact top 10, scores and all (the oracle)
    everything = RerankedIndex(codes, raw, 0, Rerank(k_factor=1, min_candidates=len(x)))
    s, i = everything.search(queries, 10)
    assert i.tolist() == truth.tolist()
    np.testing.assert_allclose(s, np.take_along_axis(exact, truth, 1), atol=1e-6)
    # the default candidates: exact scores for what they return, and more of the true top 10 than
    # the PQ8 codes' own order
    s, i = RerankedIndex(codes, raw).search(queries, 10)
    np.testing.assert_allclose(s, np.take_along_axis(exact, i, 1), atol=1e-6)
    _, by_codes = codes.search(queries, 10)
    hits = [len(set(a) & set(t)) for a, t in zip(i.tolist(), truth.tolist(), strict=True)]
    hits_codes = [len(set(a) & set(t)) for a, t in zip(by_codes.tolist(), truth.tolist(), strict=True)]
    assert np.mean(hits) >= 9.5 and np.mean(hits) > np.mean(hits_codes) + 1


def test_an_on_disk_index_folder_is_served_memory_mapped(tiny_checkpoint, tmp_path):
    import faiss
    from PIL import Image

    from icr.index.filters import parse_filter
    from icr.service.retriever import Retriever

    photos = tmp_path / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(photos / f"{i}.png")
    distractors = tmp_path / "distractors.npy"
    np.save(distractors, _unit(4_000, 32, 2))
    out = tmp_path / "idx"
    manifest = build_photo_index(
        tiny_checkpoint, images=photos, distractor_embeddings=distractors, on_disk=True,
        memory_budget_bytes=64 << 20, out=out, progress=False, gpu="off",
    )  # fmt: skip
    assert manifest.ntotal == 4_006 and manifest.factory == "IVF253,Flat"
    assert manifest.extra["on_disk"] and set(manifest.files) == {
        "index.faiss",
        "metadata.sqlite",
        ONDISK_DATA,
    }
    assert manifest.recall_check["nprobe"] is not None and manifest.recall_check["recall"] >= 0.95
    index, _, store = load_index_dir(out)
    ivf = faiss.extract_index_ivf(index)
    assert type(faiss.downcast_InvertedLists(ivf.invlists)).__name__ == "OnDiskInvertedLists"
    store.close()

    retriever = Retriever.load(out, tiny_checkpoint, gpu="off")
    query = retriever.encode_image(Image.open(photos / "3.png").convert("RGB"))  # (1, D)
    page = retriever.search(retriever.images, query, k=5, offset=0, depth=100, timings={})
    assert page.ids[0] == 3 and page.scores[0] == pytest.approx(1.0, abs=1e-5)
    gallery_only = parse_filter({"is_distractor": False}, [])
    only = retriever.search(
        retriever.images, query, k=10, offset=0, depth=100, filter_=gallery_only, timings={}
    )
    assert sorted(only.ids.tolist()) == list(range(6)) and only.matched == 6


def test_an_on_disk_re_ranked_folder_maps_its_raw_vectors(tiny_checkpoint, tmp_path):
    from PIL import Image

    from icr.index.rerank import RAW_FILE, RerankedIndex
    from icr.service.retriever import Retriever

    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(3):
        Image.fromarray(np.full((32, 32, 3), 60 * i, np.uint8)).save(photos / f"{i}.png")
    distractors = tmp_path / "distractors.npy"
    np.save(distractors, _unit(6_000, 32, 2))
    out = tmp_path / "idx"
    for factory, why in [("IVF32,PQ8x4fs,RFlat", "no fast-scan lists on disk"), ("HNSW32", "inverted-file")]:
        with pytest.raises(ValueError, match=why):
            build_photo_index(
                tiny_checkpoint, images=photos, distractor_embeddings=distractors, on_disk=True,
                factory=factory, out=out, progress=False, gpu="off",
            )  # fmt: skip
    manifest = build_photo_index(
        tiny_checkpoint, images=photos, distractor_embeddings=distractors, on_disk=True,
        factory="IVF32,PQ8,RFlat", memory_budget_bytes=64 << 20, out=out, progress=False, gpu="off",
    )  # fmt: skip
    assert set(manifest.files) == {"index.faiss", "metadata.sqlite", ONDISK_DATA, RAW_FILE}
    index, _, store = load_index_dir(out)  # mmap=False: the raw vectors are mapped all the same
    store.close()
    assert isinstance(index, RerankedIndex)
    base = index.raw
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)  # mapped, not read
    x = np.asarray(index.raw)  # (6003, 32): the 3 photos' vectors, then the distractors
    assert x.shape == (6_003, 32) and np.array_equal(x[3:], np.load(distractors))

    retriever = Retriever.load(out, tiny_checkpoint, gpu="off")
    page = retriever.search(retriever.images, x[1234][None], k=5, offset=0, depth=100, timings={})
    assert page.ids[0] == 1234 and page.scores[0] == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(page.scores, x[page.ids] @ x[1234], atol=1e-6)  # exact, not PQ's
