"""torch.distributed helpers for data-parallel contrastive training; identities in one process.

Contrastive losses need every rank's embeddings as negatives, so the training step is:

1. each rank embeds its local batch (B rows) and :func:`all_gather_with_grad` concatenates the
   ranks' rows into the global batch (world_size * B rows, rank ``r`` at rows ``[rB, (r+1)B)``);
2. every rank computes the SAME global loss ``L`` on the gathered batch;
3. ``backward()``: the gather's backward keeps the slice of ``dL/d(gathered)`` for this rank's rows,
   which is exactly ``dL/d(local rows)`` - the other slices belong to rows this rank did not compute;
4. :func:`sum_gradients` all-reduces (SUM) the parameter gradients: each rank holds the part of
   ``dL/dθ`` that flows through its own rows, and the full gradient is their sum.

Parameters used *directly* by the loss on the gathered batch (a learnable temperature, a Lagrange
multiplier) get the full ``dL/dθ`` on every rank already: reduce those with
:func:`average_gradients`, never with :func:`sum_gradients` (that would multiply them by world_size).

Launch with ``torchrun --nproc-per-node N ...`` and call :func:`init_from_env` once at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_MAX_DIMS = 16  # the shape check sends shapes padded to a fixed length (all_gather needs equal sizes)


def is_distributed() -> bool:
    """True when a process group is initialised (even with a world size of 1)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's global rank; 0 without a process group."""
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """Number of processes; 1 without a process group."""
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """True on the rank that logs, evaluates and writes checkpoints (rank 0)."""
    return rank() == 0


def _comm_device() -> torch.device:
    # NCCL only moves CUDA tensors; gloo only CPU ones (for the small bookkeeping tensors here).
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_ints(values: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every rank's ``values`` (at most _MAX_DIMS ints, lengths may differ between ranks)."""
    encoded = torch.full((_MAX_DIMS + 1,), -1, dtype=torch.int64)  # (length, values..., -1 padding)
    encoded[0] = len(values)
    encoded[1 : len(values) + 1] = torch.tensor(values, dtype=torch.int64)
    encoded = encoded.to(_comm_device())
    gathered = [torch.empty_like(encoded) for _ in range(world_size())]
    dist.all_gather(gathered, encoded)
    return [tuple(int(n) for n in g[1 : int(g[0]) + 1].tolist()) for g in gathered]


def _check_equal_shapes(x: Tensor, what: str) -> None:
    """ValueError on every rank unless all ranks pass tensors of the same shape.

    Every rank receives the same gathered shapes, so all of them raise together instead of one rank
    raising and the others hanging in the next collective.
    """
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"{what}: tensors with more than {_MAX_DIMS} dimensions are not supported")
    shapes = _gather_ints(tuple(x.shape))
    if any(shape != shapes[0] for shape in shapes):
        per_rank = ", ".join(f"rank {r}: {shape}" for r, shape in enumerate(shapes))
        raise ValueError(
            f"{what} needs the same tensor shape on every rank, got {per_rank}. Give every rank the "
            f"same batch size (drop_last=True in the DataLoader / DistributedSampler)."
        )


def _gather(x: Tensor) -> Tensor:
    chunks = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(chunks, x)
    return torch.cat(chunks, dim=0)  # (world_size * B, ...)


class _AllGatherWithGrad(torch.autograd.Function):
    """Concatenate every rank's rows; backward keeps the gradient slice of this rank's rows.

    ``ctx`` is typed Any, as torch types it: autograd's context takes whatever attributes forward
    stores on it for backward (``rows`` here).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # x: (B, ...)
        ctx.rows = x.shape[0]
        return _gather(x.contiguous())  # (world_size * B, ...)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # grad: (world_size * B, ...)
        # No all-reduce here: every rank computed the same global loss, so its own slice already is
        # dL/d(local rows); the cross-rank sum happens once, on the parameters (sum_gradients).
        start = rank() * ctx.rows
        return grad[start : start + ctx.rows]  # (B, ...)


def all_gather_with_grad(x: Tensor) -> Tensor:
    """``x`` (B, ...) of every rank concatenated along dim 0 -> (world_size * B, ...), differentiable.

    Rank ``r``'s rows are at ``[r*B, (r+1)*B)``. Every rank must pass the same shape (ValueError
    otherwise). Identity without a process group. See the module docstring for the gradient rule.
    """
    if not is_distributed():
        return x
    _check_equal_shapes(x, "all_gather_with_grad")
    gathered: Tensor = _AllGatherWithGrad.apply(x)  # Function.apply is untyped: returns forward's result
    return gathered


def all_gather_nograd(x: Tensor) -> Tensor:
    """Like :func:`all_gather_with_grad` without autograd, for ids and labels. Identity in one process."""
    if not is_distributed():
        return x.detach()
    _check_equal_shapes(x, "all_gather_nograd")
    with torch.no_grad():
        return _gather(x.detach().contiguous())


def _unique_params(module_or_params: nn.Module | Iterable[Tensor]) -> list[Tensor]:
    params = module_or_params.parameters() if isinstance(module_or_params, nn.Module) else module_or_params
    seen: set[int] = set()
    unique = []
    for p in params:  # a parameter listed twice must not be reduced twice
        if id(p) not in seen:
            seen.add(id(p))
            unique.append(p)
    return unique


def _all_reduce_grads(module_or_params: nn.Module | Iterable[Tensor], average: bool) -> None:
    if not is_distributed():
        return
    grads = [p.grad for p in _unique_params(module_or_params) if p.grad is not None]
    if any(g.is_sparse for g in grads):
        raise ValueError("sparse gradients are not supported: build embeddings with sparse=False")
    # All ranks must reduce the same buffers in the same order, or the collectives below hang or
    # mix up tensors. A parameter unused on one rank only (grad None there) is the usual cause.
    counts = _gather_ints((len(grads), sum(g.numel() for g in grads)))
    if any(c != counts[0] for c in counts):
        per_rank = ", ".join(f"rank {r}: {n} tensors / {numel} values" for r, (n, numel) in enumerate(counts))
        raise ValueError(
            f"gradient reduction needs gradients for the same parameters on every rank, got {per_rank}. "
            f"Every rank must run the same model code path (no parameter used on some ranks only)."
        )
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for group in groups.values():
        # One collective per (device, dtype): many small all-reduces are latency-bound.
        flat = torch.cat([g.reshape(-1) for g in group])  # (total numel,)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if average:
            flat /= world_size()
        for g, reduced in zip(group, flat.split([g.numel() for g in group]), strict=True):
            g.copy_(reduced.view_as(g))


def sum_gradients(module_or_params: nn.Module | Iterable[Tensor]) -> None:
    """All-reduce (SUM) every ``.grad`` in place (``None`` grads are skipped). No-op in one process.

    For parameters that reach the loss through :func:`all_gather_with_grad` (the encoders). Every
    rank must have gradients for the same parameters (ValueError otherwise).
    """
    _all_reduce_grads(module_or_params, average=False)


def average_gradients(module_or_params: nn.Module | Iterable[Tensor]) -> None:
    """All-reduce (MEAN) every ``.grad`` in place. For parameters the global loss uses directly.

    Their gradient is the same on every rank, so averaging only removes floating-point drift.
    """
    _all_reduce_grads(module_or_params, average=True)


def broadcast_parameters(module: nn.Module, src: int = 0) -> None:
    """Copy ``src``'s parameters and buffers (BatchNorm statistics) to every rank, in place."""
    if not is_distributed():
        return
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=src)


def init_from_env(backend: str | None = None, timeout: timedelta | None = None) -> bool:
    """Initialise the process group from torchrun's environment; returns whether it did.

    Returns False when ``RANK``/``WORLD_SIZE`` are not set (a plain ``python`` run) or a group is
    already initialised. ``backend`` defaults to nccl when CUDA is available, else gloo; with nccl
    the CUDA device is set from ``LOCAL_RANK`` first. ``timeout`` bounds how long a collective waits
    for the other ranks (torch's default otherwise).
    """
    if is_distributed() or "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return False
    missing = [name for name in _TORCHRUN_VARS if name not in os.environ]
    if missing:
        raise ValueError(
            f"RANK and WORLD_SIZE are set but {', '.join(missing)} are not: launch with torchrun, or "
            f"set all of {', '.join(_TORCHRUN_VARS)}"
        )
    values = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        try:
            values[name] = int(os.environ[name])
        except ValueError:
            value = os.environ[name]
            raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local_rank = values["LOCAL_RANK"]
        if not 0 <= local_rank < torch.cuda.device_count():
            raise ValueError(
                f"LOCAL_RANK={local_rank} but this machine has {torch.cuda.device_count()} CUDA devices: "
                f"start at most one process per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
    dist.init_process_group(  # timeout None: torch's default
        backend=backend,
        init_method="env://",
        timeout=timeout,
        rank=values["RANK"],
        world_size=values["WORLD_SIZE"],
    )
    return True


def cleanup() -> None:
    """Destroy the process group if there is one (call at the end of training)."""
    if is_distributed():
        dist.destroy_process_group()


def barrier() -> None:
    """Wait for every process (no-op in one process): e.g. while rank 0 validates and saves."""
    if is_distributed():
        dist.barrier()


def main_decides(flag: bool) -> bool:
    """Rank 0's ``flag`` on every process (e.g. early stopping, which only rank 0 can judge)."""
    if not is_distributed():
        return flag
    return bool(_gather_ints((int(flag),))[0][0])
