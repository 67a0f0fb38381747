"""bench/rendered_vectors.py: the distractors embedded in order after the given first rows, the same
file after a resumed run, and the queries as the checkpoint embeds the sampled captions."""

from __future__ import annotations

import numpy as np

from bench.rendered_vectors import queries, write
from icr.training.checkpoint import load_checkpoint
from icr.training.data.synthetic.generate import DistractorStream
from icr.training.data.training_data import open_split
from icr.training.embedding import embed_captions, embed_image_batch


def test_rows_are_the_first_then_each_distractor_embedded_and_a_resume_writes_the_same(
    tiny_checkpoint, tiny_benchmark, tmp_path
):
    model, meta = load_checkpoint(tiny_checkpoint)
    first = np.random.default_rng(0).standard_normal((5, meta.embed_dim)).astype(np.float32)
    out = tmp_path / "v.npy"
    write(tiny_checkpoint, tiny_benchmark, 45, out, first, batch=8)
    rows = np.load(out)
    stream = DistractorStream.for_dataset(tiny_benchmark, 40)
    naive = np.stack([embed_image_batch(model, stream.image(k)[None])[0] for k in range(40)])  # (40, D)
    assert rows.shape == (45, meta.embed_dim) and np.array_equal(rows[:5], first)
    np.testing.assert_allclose(rows[5:], naive, atol=1e-5)
    # a run stopped after 16 distractors (rows past them never written) continues from there
    (tmp_path / "v.npy.done").write_text("16")
    stopped = np.lib.format.open_memmap(out, mode="r+")
    stopped[5 + 16 :] = 0
    stopped.flush()
    del stopped
    write(tiny_checkpoint, tiny_benchmark, 45, out, first, batch=8)
    assert np.array_equal(np.load(out), rows)


def test_queries_are_the_sampled_test_captions_embedded(tiny_checkpoint, tiny_benchmark):
    model, _ = load_checkpoint(tiny_checkpoint)
    captions = open_split(tiny_benchmark, "test").captions
    pick = np.random.default_rng(3).choice(len(captions), 4, replace=False)
    want = embed_captions(model, [captions[k] for k in pick])
    np.testing.assert_allclose(queries(tiny_checkpoint, tiny_benchmark, 4, seed=3), want, atol=1e-6)


def test_the_scale_section_indexes_given_vectors_as_they_are(tmp_path):
    """``icr bench --scale-vectors/--scale-queries``: the on-disk index is built from the file, not
    resampled, and its widest probe finds the exact neighbours of the file's queries."""
    from bench import scale

    rng = np.random.default_rng(0)
    centres = rng.standard_normal((50, 32))  # (C, D)
    rows = centres[rng.integers(0, 50, 30_000)] + 0.3 * rng.standard_normal((30_000, 32))  # (N, D)
    rows = (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)
    queries = rows[:40] + 0.05 * rng.standard_normal((40, 32)).astype(np.float32)  # (Q, D)
    np.save(tmp_path / "v.npy", rows)
    np.save(tmp_path / "q.npy", queries / np.linalg.norm(queries, axis=1, keepdims=True))
    logged: list[str] = []
    given = (tmp_path / "v.npy", tmp_path / "q.npy")
    d = scale.on_disk(tmp_path / "unused.npy", tmp_path, True, logged.append, given)
    assert d.get("failed") is None, d
    assert d["vectors_file"] == str(tmp_path / "v.npy") and d["vectors"] == 30_000 and d["queries"] == 40
    widest = d["search"][-1]  # nprobe 128 of the few hundred lists of 30,000 vectors
    assert widest["nprobe"] == 128 and widest["codes_only"]["recall_at_10"] >= 0.99  # IVF<k>,Flat fits
    assert "30,000 vectors from" in logged[0]


def test_scale_files_go_together_and_must_exist(tmp_path):
    import pytest

    from bench.cli import _scale_files

    (tmp_path / "v.npy").write_bytes(b"")
    assert _scale_files(None, None) is None
    with pytest.raises(ValueError, match="give both or neither"):
        _scale_files(tmp_path / "v.npy", None)
    with pytest.raises(ValueError, match="q.npy: no such file"):
        _scale_files(tmp_path / "v.npy", tmp_path / "q.npy")
    assert _scale_files(tmp_path / "v.npy", tmp_path / "v.npy") == (tmp_path / "v.npy",) * 2
