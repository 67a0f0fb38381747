"""Distributed helpers: identities in one process; a real 2-process gloo group must reproduce the
single-process gradient of a loss that mixes every row of the global batch."""

from __future__ import annotations

import math
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from icr.training.distributed import (
    all_gather_nograd,
    all_gather_with_grad,
    average_gradients,
    broadcast_parameters,
    cleanup,
    init_from_env,
    is_distributed,
    is_main,
    rank,
    sum_gradients,
    world_size,
)

WORLD = 2
BATCH = 8  # global batch; each rank holds BATCH // WORLD rows


class _DualTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleDict({"img": nn.Linear(6, 4), "cap": nn.Linear(5, 4)})
        # Used by the loss directly (not through the gathered rows): averaged, not summed.
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def embed(self, x_img: torch.Tensor, x_cap: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        img = F.normalize(self.towers["img"](x_img), dim=-1)  # (B, 4)
        cap = F.normalize(self.towers["cap"](x_cap), dim=-1)  # (B, 4)
        return img, cap


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x_img = torch.randn(BATCH, 6, generator=gen, dtype=torch.float64)
    x_img[3] = x_img[6]  # a duplicate image, as caption-level sampling produces
    x_cap = torch.randn(BATCH, 5, generator=gen, dtype=torch.float64)
    return x_img, x_cap


def _loss(img: torch.Tensor, cap: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE over the whole (B, B) similarity matrix: every row affects every gradient."""
    logits = logit_scale.exp() * img @ cap.T  # (B, B)
    target = torch.arange(img.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(local_rank: int, port: int, folder: str) -> None:
    """One rank: results go to ``{folder}/rank{r}.pt``; the parent process does the asserting."""
    os.environ.update(
        RANK=str(local_rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(local_rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    if not init_from_env(backend="gloo", timeout=timedelta(seconds=60)):
        raise RuntimeError("init_from_env did not initialise the process group")
    try:
        out: dict = {"rank": rank(), "world_size": world_size(), "is_main": is_main()}
        out["is_distributed"] = is_distributed()
        model = _DualTower().double()
        model.load_state_dict(torch.load(Path(folder) / "init.pt"))
        if rank() != 0:
            with torch.no_grad():  # diverge from rank 0 so broadcast_parameters has something to do
                for p in model.parameters():
                    p.add_(1.0)
        broadcast_parameters(model)
        out["params"] = {k: v.clone() for k, v in model.state_dict().items()}

        x_img, x_cap = _inputs()
        half = BATCH // WORLD
        rows = slice(rank() * half, (rank() + 1) * half)
        img_local, cap_local = model.embed(x_img[rows], x_cap[rows])  # (B/2, 4) each
        img = all_gather_with_grad(img_local)  # (B, 4)
        cap = all_gather_with_grad(cap_local)  # (B, 4)
        out["ids"] = all_gather_nograd(torch.arange(BATCH)[rows])
        loss = _loss(img, cap, model.logit_scale)
        loss.backward()
        out["scale_grad_before_reduce"] = model.logit_scale.grad.clone()
        sum_gradients(model.towers)
        average_gradients([model.logit_scale])
        out["img"], out["cap"], out["loss"] = img.detach(), cap.detach(), loss.detach()
        out["grads"] = {name: p.grad.clone() for name, p in model.named_parameters()}

        # Unequal sizes must raise on every rank (not hang).
        uneven = torch.zeros(3 if rank() == 0 else 2, 4)
        for name, gather in (("with_grad", all_gather_with_grad), ("nograd", all_gather_nograd)):
            try:
                gather(uneven)
            except ValueError as err:
                out[f"uneven_{name}"] = str(err)
        a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
        a.grad = torch.ones(2)
        if rank() == 0:
            b.grad = torch.ones(3)  # b has a gradient on rank 0 only
        try:
            sum_gradients([a, b])
        except ValueError as err:
            out["grad_mismatch"] = str(err)
        torch.save(out, Path(folder) / f"rank{rank()}.pt")
    finally:
        cleanup()


def test_two_process_gradients_equal_single_process_full_batch(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _DualTower().double()
    torch.save(model.state_dict(), tmp_path / "init.pt")

    # Reference: one process, the full batch.
    x_img, x_cap = _inputs()
    img, cap = model.embed(x_img, x_cap)
    loss = _loss(img, cap, model.logit_scale)
    names, params = zip(*model.named_parameters(), strict=True)
    want = dict(zip(names, torch.autograd.grad(loss, params), strict=True))

    torch.multiprocessing.spawn(_worker, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True)

    for r in range(WORLD):
        out = torch.load(tmp_path / f"rank{r}.pt")
        identity = (out["rank"], out["world_size"], out["is_main"], out["is_distributed"])
        assert identity == (r, WORLD, r == 0, True)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(out["params"][key], value)  # rank 0's weights everywhere
        torch.testing.assert_close(out["img"], img.detach())  # rank r's rows at [r*B/2, (r+1)*B/2)
        torch.testing.assert_close(out["cap"], cap.detach())
        torch.testing.assert_close(out["ids"], torch.arange(BATCH))
        torch.testing.assert_close(out["loss"], loss.detach())
        # Every rank computes the same global loss, so the loss's own parameter has the full
        # gradient before any reduction (this is why it is averaged, not summed).
        torch.testing.assert_close(out["scale_grad_before_reduce"], want["logit_scale"])
        assert out["grads"].keys() == want.keys()
        for name, grad in want.items():
            torch.testing.assert_close(out["grads"][name], grad, msg=f"rank {r}, gradient of {name}")
        for name in ("with_grad", "nograd"):
            message = out.get(f"uneven_{name}", "")
            assert "rank 0: (3, 4), rank 1: (2, 4)" in message and "drop_last" in message, (r, name)
        mismatch = out.get("grad_mismatch", "")
        assert "rank 0: 2 tensors" in mismatch and "rank 1: 1 tensors" in mismatch


# --- one process, no process group ---------------------------------------------------------------
def test_single_process_helpers_are_identities() -> None:
    assert not is_distributed()
    assert (rank(), world_size(), is_main()) == (0, 1, True)
    x = torch.randn(5, 3, requires_grad=True)
    gathered = all_gather_with_grad(x)
    assert gathered is x
    (gathered * torch.arange(3.0)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(3.0).expand(5, 3))
    ids = all_gather_nograd(torch.arange(4))
    torch.testing.assert_close(ids, torch.arange(4))
    assert not all_gather_nograd(x).requires_grad

    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    before = {n: (p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    sum_gradients(model)
    average_gradients(model.parameters())
    broadcast_parameters(model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[name][0])
        torch.testing.assert_close(p.grad, before[name][1])
    cleanup()  # no-op without a group
    assert not is_distributed()


def test_init_from_env_without_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert init_from_env() is False
    assert not is_distributed()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not"):
        init_from_env(backend="gloo")
    for name, value in (("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ValueError, match="RANK must be an integer"):
        init_from_env(backend="gloo")
    assert not is_distributed()
