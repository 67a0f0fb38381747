"""service/sharded_index.py: shards searched as one index, in process. Every search a client can
make (thresholds by score and by calibrated relevance, filters, pages, a stored image's neighbours)
answers the same on 2 and 4 exact shards as on the single index they were cut from; a shard that
does not answer gives a partial answer that says so, or ShardsUnavailable when every shard is
required. (The same coordinator over Ray Serve deployments: api_tests/test_cluster.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from icr.index.build import build_image_index
from icr.index.calibration import calibrate_index
from icr.index.filters import parse_filter
from icr.index.live_writes import NewImage, UnknownImage
from icr.index.shard import shard_index
from icr.service.retriever import Page, Retriever
from icr.service.shard_replica import ShardReplica, shard_state_dir
from icr.service.sharded_index import LocalShard, ShardSet, ShardsUnavailable

pytestmark = pytest.mark.usefixtures("faiss_one_thread")

TEXTS = ["a red circle", "two shapes", "a big blue square on a dark background"]


@pytest.fixture(scope="module")
def single(tiny_benchmark: Path, tiny_checkpoint: Path, tmp_path_factory) -> Retriever:
    images = tmp_path_factory.mktemp("sharded") / "images"
    build_image_index(tiny_checkpoint, tiny_benchmark, distractors=50, out=images, progress=False, gpu="off")
    calibrate_index(images, progress=False, generated=60)
    return Retriever.load(images, gpu="off")


@pytest.fixture(scope="module", params=[2, 4])
def sharded(request, single: Retriever, tmp_path_factory) -> Iterator[tuple[Retriever, list[LocalShard]]]:
    out = tmp_path_factory.mktemp(f"shards{request.param}")
    folders = [Path(w["folder"]) for w in shard_index(single.images.directory, out, request.param)]
    pool = ThreadPoolExecutor(8)
    backends = [LocalShard(ShardReplica(f, gpu="off"), pool) for f in reversed(folders)]  # any order
    retriever = Retriever.load(folders[0], gpu="off", shards=ShardSet(list(backends), timeout_s=30))
    yield retriever, backends
    pool.shutdown()
    for b in backends:
        b.replica.close()


def _same(a: Page, b: Page) -> None:
    """Equal pages up to the order of tied scores."""
    np.testing.assert_allclose(a.scores, b.scores, atol=1e-6)
    for i in np.flatnonzero(a.ids != b.ids):  # ids may differ only inside a run of equal scores
        assert np.isclose(a.scores, a.scores[i], atol=1e-6).sum() > 1
    assert (a.passed, a.passed_is_exact, a.searched, a.matched) == (
        b.passed,
        b.passed_is_exact,
        b.searched,
        b.matched,
    )
    assert a.threshold["kind"] == b.threshold["kind"]
    if a.relevance is None:
        assert b.relevance is None
    else:
        np.testing.assert_allclose(a.relevance, b.relevance, atol=1e-6)
        assert a.expected_relevant == pytest.approx(b.expected_relevant, abs=1e-6)
    assert [r["id"] for r in b.rows] == b.ids.tolist()
    assert {r["id"]: r for r in a.rows} == {r["id"]: r for r in b.rows}


@pytest.mark.parametrize("text", TEXTS)
def test_every_search_answers_as_the_single_index(single: Retriever, sharded, text: str) -> None:
    coordinator, _ = sharded
    query = single.encode_text(text)  # (1, D)
    np.testing.assert_array_equal(coordinator.encode_text(text), query)
    ntotal = single.images.live.state.size
    assert coordinator.images.live.state.size == ntotal
    distractors = parse_filter({"is_distractor": True}, [])
    for kwargs in (
        {"k": 10, "offset": 0, "depth": ntotal},
        {"k": 5, "offset": 7, "depth": 30},
        {"k": 20, "offset": 0, "depth": 40, "min_relevance": 0.3},
        {"k": 20, "offset": 3, "depth": ntotal, "min_relevance": 0.0},
        {"k": 20, "offset": 0, "depth": ntotal, "min_score": 0.1},
        {"k": 10, "offset": 0, "depth": 25, "filter_": distractors},
        {"k": 10, "offset": 2, "depth": ntotal, "filter_": distractors, "min_relevance": 0.1},
    ):
        want = single.search(single.images, query, text=text, timings={}, **kwargs)
        got = coordinator.search(coordinator.images, query, text=text, timings={}, **kwargs)
        _same(want, got)
        assert got.calibration == want.calibration == "per_query" and not got.unanswered


def test_a_stored_images_neighbours_and_rows_come_from_their_owners(single: Retriever, sharded) -> None:
    coordinator, _ = sharded
    for item in (0, single.images.manifest.ntotal - 1):
        query = single.stored_vector(single.images, item)
        np.testing.assert_allclose(coordinator.stored_vector(coordinator.images, item), query, atol=1e-7)
        kwargs = {"k": 10, "offset": 0, "depth": 30, "calibrated": False, "exclude": item}
        distractors = parse_filter({"is_distractor": True}, [])
        for extra in ({}, {"filter_": distractors}):
            want = single.search(single.images, query, timings={}, **kwargs, **extra)
            _same(want, coordinator.search(coordinator.images, query, timings={}, **kwargs, **extra))
    live = coordinator.images.live
    assert not live.state.is_live(10**9)
    with pytest.raises(KeyError):
        live.rows([10**9], live.state)
    assert coordinator.images.summary()["images"] == single.images.summary()["images"]


def test_a_shard_that_does_not_answer_is_named_never_dropped_silently(single: Retriever, sharded) -> None:
    coordinator, backends = sharded
    text = "a red circle"
    query = single.encode_text(text)  # (1, D)
    full = coordinator.search(coordinator.images, query, k=200, offset=0, depth=200, text=text, timings={})
    down = backends[0]  # whichever shard that is
    name = down.replica.folder.name
    down.down = True
    try:
        partial = coordinator.search(
            coordinator.images, query, k=200, offset=0, depth=200, text=text, timings={}
        )
        assert partial.unanswered == [name] and not partial.passed_is_exact
        lo, hi = down.replica.shard["ids"]
        assert not ((partial.ids >= lo) & (partial.ids < hi)).any()  # its images are missing, said so
        others = full.ids[(full.ids < lo) | (full.ids >= hi)]
        np.testing.assert_array_equal(partial.ids, others)  # and only its images
        coordinator.images.live.shards.require_all = True
        with pytest.raises(ShardsUnavailable, match=name):
            coordinator.search(coordinator.images, query, k=5, offset=0, depth=20, text=text, timings={})
    finally:
        down.down = False
        coordinator.images.live.shards.require_all = False
    again = coordinator.search(coordinator.images, query, k=200, offset=0, depth=200, text=text, timings={})
    assert not again.unanswered and again.passed_is_exact == full.passed_is_exact
    np.testing.assert_array_equal(again.ids, full.ids)


def test_shards_of_different_builds_or_a_missing_shard_are_refused(single: Retriever, tmp_path: Path) -> None:
    folders = [Path(w["folder"]) for w in shard_index(single.images.directory, tmp_path / "s", 3)]
    with ThreadPoolExecutor(4) as pool:
        replicas = [ShardReplica(f, gpu="off") for f in folders]
        with pytest.raises(ValueError, match="expected shards 0..1 of 2"):
            ShardSet([LocalShard(r, pool) for r in replicas[:2]])
        with pytest.raises(Exception, match="not a shard folder"):
            ShardReplica(single.images.directory, gpu="off")
        for r in replicas:
            r.close()


def _writable(
    folders: list[Path], state: Path, pool: ThreadPoolExecutor
) -> tuple[Retriever, list[LocalShard]]:
    backends = [
        LocalShard(ShardReplica(f, gpu="off", writes=shard_state_dir(state, f)), pool) for f in folders
    ]
    shards = ShardSet(list(backends), timeout_s=30)
    return Retriever.load(folders[0], gpu="off", shards=shards, writes=state), backends


def test_writes_routed_to_the_owning_shards_answer_as_on_the_single_index(
    single: Retriever, sharded, tmp_path: Path
) -> None:
    """The same writes on a writable copy of the single index and on its shards (each with a log of
    its own): the same acks, counts and sequence number, then every search answers the same; a
    second replica of a shard sees its writes at its next call; a write spanning a shard that does
    not answer fails naming it, the others' parts stand, and sending it again completes it."""
    _, read_only = sharded
    folders = sorted((b.replica.folder for b in read_only), key=lambda f: int(f.name.split("-")[1]))
    one = Retriever.load(single.images.directory, gpu="off", writes=tmp_path / "single")
    pool = ThreadPoolExecutor(8)
    coordinator, backends = _writable(folders, tmp_path / "state", pool)
    a, b = one.images.live, coordinator.images.live
    assert a.writable and b.writable and b.uploads == tmp_path / "state" / "uploads"
    n, dim = one.images.manifest.ntotal, one.images.manifest.dim
    rng = np.random.default_rng(0)
    near = one.encode_text("a red circle")[0]  # (D,) added images that rank at the top

    def image(k: int, name: str | None = None) -> NewImage:
        vector = near + 0.3 * rng.standard_normal(dim).astype(np.float32)  # (D,)
        return NewImage(vector / np.linalg.norm(vector), {"source": f"added-{k}", "captions": []}, name)

    def both(method: str, *args) -> list:
        acks = [getattr(live, method)(*args) for live in (a, b)]
        if method == "patch":
            acks = [[ack] for ack in acks]
        # a shard's acks carry its own log's seq: the rest is the same
        assert [[(x.op, x.id, x.external_id, x.replaced) for x in acked] for acked in acks] == [
            [(x.op, x.id, x.external_id, x.replaced) for x in acks[0]]
        ] * 2, method
        assert (a.state.size, a.state.seq, a.state.added, a.state.deleted) == (
            b.state.size,
            b.state.seq,
            b.state.added,
            b.state.deleted,
        )
        return acks[0]

    added = both("add", [image(0, "x"), image(1), image(2)], "t")
    assert [ack.id for ack in added] == [n, n + 1, n + 2]  # past the whole index: the last shard's
    assert coordinator.images.live.shards.owner(n + 2) == len(folders) - 1
    both("patch", 1, {"color": "red"}, "t")
    both("delete", [0, n - 1, n // 2, n + 1, 10**9], "t")  # spans the first, middle and last shards
    both("delete_matching", parse_filter({"is_distractor": True}, []), "t")
    replaced = both("add", [image(3, "x")], "t")
    assert [(ack.op, ack.id, ack.replaced) for ack in replaced] == [("add", n + 3, n)]
    state = b.state
    assert state.is_live(n + 3) and not state.is_live(n) and not state.is_live(0)
    assert b.rows([1], state) == a.rows([1], a.state)
    np.testing.assert_allclose(
        coordinator.stored_vector(coordinator.images, n + 2), one.stored_vector(one.images, n + 2), atol=1e-7
    )
    for text in TEXTS:
        query = one.encode_text(text)  # (1, D)
        for kwargs in (
            {"k": 10, "offset": 0, "depth": n},
            {"k": 20, "offset": 0, "depth": 40, "min_relevance": 0.3},
            {"k": 10, "offset": 0, "depth": n, "filter_": parse_filter({"is_distractor": False}, [])},
        ):
            want = one.search(one.images, query, text=text, timings={}, **kwargs)
            _same(want, coordinator.search(coordinator.images, query, text=text, timings={}, **kwargs))

    # a shard's log knows the ids the shard does not hold: another shard's id is no image of it
    last_shard = backends[-1].replica
    assert last_shard.delete([1], "t").acks == [] and backends[0].replica.is_live(1)  # the first's
    with pytest.raises(UnknownImage):
        last_shard.patch(1, {"color": "blue"}, "t")

    # another replica of the last shard, on the same state directory: it sees the writes at its next call
    last = folders[-1]
    other = ShardReplica(last, gpu="off", writes=shard_state_dir(tmp_path / "state", last))
    hits = other.search(near[None, :], 5)
    assert n + 3 in hits.ids[0] and n not in hits.ids[0]
    assert other.status() == backends[-1].replica.status()
    b.add([image(4)], "t")
    assert n + 4 in other.search(near[None, :], 5).ids[0] and other.rows([n + 4])[0]["source"] == "added-4"
    a.add([image(4)], "t")

    # a write spanning a shard that does not answer: named, the others' parts stand, repeatable
    backends[0].down = True
    ids = [2, n - 2]  # the first shard's and the last's
    with pytest.raises(ShardsUnavailable, match=f"{folders[0].name}.*send the same request again"):
        b.delete(ids, "t")
    assert not backends[-1].replica.is_live(n - 2) and backends[0].replica.is_live(2)
    backends[0].down = False
    assert [ack.id for ack in b.delete(ids, "t")] == [2]  # completes it: the rest was done
    a.delete(ids, "t")
    assert b.state.size == a.state.size
    for replica in (other, *(x.replica for x in backends)):
        replica.close()
    pool.shutdown()
