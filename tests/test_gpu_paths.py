"""The CUDA paths against their CPU twins: training steps (fp32, bf16 and fp16 autocast), a torchvision
ResNet-50 tower, and FAISS on the GPU (exact search, an IVF build, ``icr index build --gpu on``).

Every test here is marked ``gpu`` and skipped without a CUDA device (and, for FAISS, without
faiss-gpu); bench/gpu_device/run.sh runs them on a lent GPU machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch
from tiny_model import TINY_MODEL

from icr.index.build import build_image_index
from icr.index.index_folder import load_index_dir
from icr.index.manifest import Manifest
from icr.index.vector_index import build_index, search
from icr.training.config import load_config
from icr.training.losses import load_all
from icr.training.train import Trainer, amp_dtype, train

CUDA = torch.cuda.is_available()
FAISS_GPU = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
needs_faiss_gpu = pytest.mark.skipif(not FAISS_GPU, reason="needs faiss-gpu and a CUDA GPU")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def data(tiny_benchmark) -> Path:
    return tiny_benchmark


@pytest.fixture(autouse=True)
def exact_fp32():
    """TF32 off, so that fp32 on the GPU is comparable with the CPU to ~1e-5."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _config(data: Path, out: Path, *extra: str, model: tuple[str, ...] = tuple(TINY_MODEL)) -> dict:
    return load_config(
        None,
        [
            f'data.path="{data}"',
            f'train.out="{out}"',
            "train.batch_size=8",
            "train.epochs=1",
            "train.max_steps=4",
            "train.val_every=0",
            "train.log_every=1",
            "optim.lr=1e-3",
            *model,
            *extra,
        ],
    )


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r["event"] == "train"]


def test_amp_choices_without_a_gpu_are_clear():
    assert amp_dtype("auto", torch.device("cpu")) is None
    assert amp_dtype("off", torch.device("cpu")) is None
    for setting in ("bf16", "fp16", "on"):
        with pytest.raises(ValueError, match=f"train.amp={setting} needs a CUDA device"):
            amp_dtype(setting, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"invalid \[train\]: amp: Input should be 'auto', 'bf16', 'fp16'"):
        load_config(None, ['train.amp="half"'])


@needs_cuda
@pytest.mark.parametrize("loss", ["triplet_hardest", "ntxent", "smoothap"])
def test_cuda_fp32_steps_match_the_cpu(data, tmp_path, loss):
    """Four optimizer steps on the GPU in fp32 give the CPU's losses: the same data order, the same
    initial weights, the same gradients (cuDNN's GRU and convolutions differ only in rounding)."""
    extra = [f'loss.name="{loss}"', 'train.amp="off"']
    if load_all()[loss].sampling == "image":
        extra.append("train.batch_size=4")  # image-level batches: 4 images x 5 captions
    runs = {}
    for device in ("cpu", "cuda"):
        train(_config(data, tmp_path / device, f'train.device="{device}"', *extra), progress=False)
        runs[device] = _losses(tmp_path / device)
    assert len(runs["cuda"]) == 4
    np.testing.assert_allclose(runs["cuda"], runs["cpu"], rtol=2e-3, atol=2e-4)


@needs_cuda
@pytest.mark.parametrize("setting, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_steps_track_fp32(data, tmp_path, setting, dtype):
    """Mixed precision changes rounding, not the objective: the first step's loss (same weights, same
    batch) is fp32's within 1 %, and every later loss is finite. fp16's loss scaler may skip the first
    steps on overflow (its initial scale is 2^16), so later losses are not compared; bf16 needs no scaler."""
    fp32 = _config(data, tmp_path / "fp32", 'train.device="cuda"', 'train.amp="off"')
    mixed = _config(data, tmp_path / setting, 'train.device="cuda"', f'train.amp="{setting}"')
    trainer = Trainer(mixed, progress=False)
    assert trainer.amp_dtype is dtype and trainer.scaler.is_enabled() == (dtype is torch.float16)
    train(fp32, progress=False)
    train(mixed, progress=False)
    reference, losses = _losses(tmp_path / "fp32"), _losses(tmp_path / setting)
    assert len(losses) == 4 and np.all(np.isfinite(losses)), losses
    assert losses[0] == pytest.approx(reference[0], rel=0.01), (losses, reference)
    if dtype is torch.bfloat16:
        np.testing.assert_allclose(losses, reference, rtol=0.05)
    assert amp_dtype("auto", torch.device("cuda")) is (
        torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    )


@needs_cuda
def test_torchvision_resnet50_tower_on_cuda(data, tmp_path):
    """A torchvision ``.pth`` ResNet-50 backbone (the ECIR runs' image tower) trains on the GPU and embeds
    like the CPU in fp32."""
    torchvision = pytest.importorskip("torchvision")
    weights = tmp_path / "resnet50.pth"
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet50(weights=None).state_dict(), weights)
    tower = (
        "model.embed_dim=32",
        'model.image.kind="resnet"',
        'model.image.arch="resnet50"',
        f'model.image.path="{weights}"',
        "model.image.image_size=64",
        *(line for line in TINY_MODEL if line.startswith("model.text")),
    )
    cfg = _config(
        data, tmp_path / "run", 'train.device="cuda"', 'train.amp="bf16"', "train.max_steps=2", model=tower
    )
    summary = train(cfg, progress=False)
    assert summary["steps"] == 2 and all(np.isfinite(_losses(tmp_path / "run")))
    model = Trainer(_config(data, tmp_path / "x", 'train.device="cpu"', model=tower), progress=False).model
    model.eval()
    images = torch.rand(4, 3, 64, 64)  # (B, 3, H, W)
    with torch.no_grad():
        on_cpu = model.encode_image(images)  # (B, D)
        on_gpu = model.to("cuda").encode_image(images.cuda()).cpu()  # (B, D)
    np.testing.assert_allclose(on_gpu.numpy(), on_cpu.numpy(), atol=1e-4)


@needs_faiss_gpu
def test_faiss_gpu_exact_search_equals_brute_force():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(5000, 64)).astype(np.float32)  # (N, D)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    queries = base[rng.choice(5000, 37, replace=False)] + 0.05 * rng.normal(size=(37, 64)).astype(np.float32)
    resources = faiss.StandardGpuResources()
    flat = faiss.GpuIndexFlatIP(resources, 64)
    flat.add(base)
    scores, ids = flat.search(queries, 10)  # (Q, 10)
    exact = queries @ base.T  # (Q, N) the naive oracle
    expected = np.argsort(-exact, axis=1)[:, :10]
    np.testing.assert_array_equal(ids, expected)
    np.testing.assert_allclose(scores, np.take_along_axis(exact, expected, axis=1), atol=1e-4)


@needs_faiss_gpu
@pytest.mark.parametrize("factory", ["IVF16,Flat", "IVF16,PQ8"])
def test_faiss_gpu_build_returns_a_cpu_index_that_searches_like_the_cpu_build(factory):
    rng = np.random.default_rng(1)
    base = rng.normal(size=(4000, 32)).astype(np.float32)
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    report: dict[str, str] = {}
    on_gpu = build_index(base, 32, factory, gpu="on", report=report)
    assert report["built_on"] == "gpu" and not isinstance(on_gpu, faiss.GpuIndex)
    queries = base[:50]
    _, ids = search(on_gpu, queries, 10, nprobe=16)  # every list probed: IVF,Flat is exact
    first = np.array([row[0] for row in ids])
    if factory == "IVF16,Flat":
        np.testing.assert_array_equal(first, np.arange(50))
    else:  # PQ codes: the query's own vector is still found first in most cases
        assert np.mean(first == np.arange(50)) > 0.8


@needs_faiss_gpu
def test_icr_index_build_gpu_on(data, tmp_path):
    run = tmp_path / "run"
    train(_config(data, run, 'train.device="cuda"', "train.max_steps=2"), progress=False)
    out = tmp_path / "idx"
    build_image_index(
        run / "last",
        data,
        distractors=200,
        out=out,
        progress=False,
        gpu="on",
        device="cuda",
        factory="IVF8,Flat",
        batch_size=64,
    )
    manifest = Manifest.read(out)
    assert manifest.built_on == "gpu" and manifest.ntotal == 212
    index, _, metadata = load_index_dir(out)
    metadata.close()
    cpu = tmp_path / "cpu"
    build_image_index(
        run / "last",
        data,
        distractors=200,
        out=cpu,
        progress=False,
        gpu="off",
        device="cpu",
        factory="Flat",
        batch_size=64,
    )
    flat, _, metadata = load_index_dir(cpu)
    metadata.close()
    vectors = flat.reconstruct_n(0, flat.ntotal)  # (N, D) the gallery embedded on the CPU
    cpu_scores, _ = search(flat, vectors[:40], 5)
    gpu_scores, gpu_ids = search(index, vectors[:40], 5, nprobe=8)  # all 8 lists: exact
    np.testing.assert_array_equal([row[0] for row in gpu_ids], np.arange(40))  # CUDA embedding = CPU's
    np.testing.assert_allclose(np.stack(gpu_scores), np.stack(cpu_scores), atol=1e-4)
