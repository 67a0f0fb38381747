"""The training loop: one objective by name, validation every epoch, exact resume.

Run state lives in ``train.out``: ``best/`` and ``last/`` checkpoints (loadable with no training
code), ``train_state.pt`` (everything needed to resume bit-for-bit: weights, optimizer, AMP scaler,
Lagrange multiplier, SWA average, step) and ``metrics.jsonl`` (one JSON object per logged step and
per validation).

Under ``torchrun`` every process embeds its slice of the global batch; the slices are gathered with
gradient so every objective sees the whole global batch as negatives, each process computes the
same global loss, and encoder gradients are summed over processes (``training.distributed``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from icr.core.devices import resolve_device
from icr.core.memory import peak_rss_mb
from icr.training import distributed as dist
from icr.training.checkpoint import save_checkpoint
from icr.training.config import OptimSection, TrainConfig
from icr.training.data.synthetic.generate import SCENES_NAME, split_scene_table
from icr.training.data.synthetic.ground_truth import PairTruth
from icr.training.data.synthetic.parse import parse_caption
from icr.training.data.training_data import PlannedBatch, SplitData, open_split, plan_epoch, synthetic_source
from icr.training.data.vocab import Vocabulary, build_vocab_from_split
from icr.training.embedding import embed_captions, embed_images
from icr.training.evaluation.retrieval import evaluate_embeddings
from icr.training.losses import build_loss
from icr.training.models import build_model, normalize_model_config
from icr.training.run_state import STATE_FILE, RunState, read_state, write_state
from icr.training.target_decoding import TargetDecoding, build_decoding, compute_latent_targets

METRICS_FILE = "metrics.jsonl"


def amp_dtype(setting: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``train.amp`` on ``device`` (None: full fp32)."""
    if setting == "off" or (setting == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda":
        raise ValueError(f"train.amp={setting} needs a CUDA device; use train.amp=auto or off on CPU")
    if setting == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if setting == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError("train.amp=bf16: this GPU has no bfloat16; use train.amp=fp16")
    return torch.bfloat16 if setting == "bf16" else torch.float16


def learning_rate(
    optim: OptimSection, epochs: int, epoch: int, global_step: int, total_steps: int = 0
) -> float:
    """A pure function of the position, so resuming needs no scheduler object."""
    lr = optim.lr
    if optim.schedule == "step":
        lr *= optim.gamma ** (epoch // optim.lr_update)
    elif optim.schedule == "cosine":  # one value per epoch
        lr *= 0.5 * (1.0 + math.cos(math.pi * epoch / max(1, epochs)))
    elif optim.schedule == "cosine_step":  # per step, to 0 at the last: for runs of few epochs
        lr *= 0.5 * (1.0 + math.cos(math.pi * global_step / max(1, total_steps)))
    elif optim.schedule == "linear":  # to 0 at train.max_steps (Cross-Example Softmax paper)
        lr *= max(0.0, 1.0 - global_step / max(1, total_steps))
    warmup = optim.warmup_steps
    if warmup > 0 and global_step < warmup:
        lr *= (global_step + 1) / warmup
    return lr


class Trainer:
    """Owns the model, objective, optimizer and data of one run (built from its typed config)."""

    def __init__(self, config: TrainConfig, *, progress: bool = True) -> None:
        self.config = config
        self.progress = progress and dist.is_main()
        tcfg, dcfg = config.train, config.data
        if tcfg.threads > 0:
            torch.set_num_threads(tcfg.threads)
        self.device = torch.device(resolve_device(tcfg.device, "train.device"))
        self.amp_dtype = amp_dtype(tcfg.amp, self.device)
        self.seed = tcfg.seed
        self.out = Path(tcfg.out).expanduser()
        world = dist.world_size()
        self.batch_size = tcfg.batch_size
        if self.batch_size % world:
            raise ValueError(f"train.batch_size={self.batch_size} must be divisible by the {world} processes")

        self.loss_fn = build_loss(config.loss.name, **config.loss.params())
        per_image = dcfg.captions_per_image
        self.train_data = open_split(
            dcfg.path,
            dcfg.train_split,
            captions_per_image=per_image,
            preload=dcfg.preload,
            progress=self.progress,
        )
        self.val_data: SplitData | None = None
        if tcfg.val_every > 0:
            self.val_data = open_split(
                dcfg.path, dcfg.val_split, captions_per_image=per_image, preload=False
            ).head(dcfg.val_images)

        self.pair_truth = self._pair_truth(dcfg.positives)
        model_cfg = normalize_model_config(config.model)
        self.vocab = self._vocabulary(model_cfg)
        torch.manual_seed(self.seed)  # identical initial weights on every process and every run
        self.model = build_model(model_cfg, self.vocab).to(self.device)
        self.learns_logit_scale = self._learned_logit_scale()
        self.decoding = self._decoding()
        self.optimizer = self._optimizer()
        # loss scaling only for fp16: bf16 has fp32's exponent range, so gradients do not underflow
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_dtype == torch.float16)
        self.swa: torch.optim.swa_utils.AveragedModel | None = None
        self.state = RunState()
        self.train_transform = self.model.image_transform(train=True)

    # --- construction -----------------------------------------------------------------------
    def _vocabulary(self, model_cfg: dict[str, Any]) -> Vocabulary | None:
        needs_vocab = model_cfg["text"]["kind"] == "gru" or self.config.decoding.get("kind") == "itd"
        if not needs_vocab:
            return None

        return build_vocab_from_split(self.train_data)

    def _pair_truth(self, positives: str) -> Any:
        """``data.positives = "ground_truth"``: the generator's truth for any batch's pairs."""
        if positives == "annotations":
            return None

        source = synthetic_source(self.train_data)  # the benchmark, or features extracted from it
        if source is None:
            raise ValueError(
                f"data.positives=ground_truth needs the embedded benchmark's scene structures "
                f"({SCENES_NAME} beside the dataset, written by `icr data synth`, or a features folder "
                f"from `icr data features`); {self.train_data.source} has none: "
                "use data.positives=annotations"
            )
        queries = [parse_caption(c) for c in self.train_data.captions]
        return PairTruth(queries, split_scene_table(*source))

    def _learned_logit_scale(self) -> bool:
        """Whether the model's learned logit scale replaces the objective's temperature (or scale).

        An objective without one leaves the parameter frozen, as loaded: nothing changes. A scale
        with no pretrained value starts from the objective's own temperature.
        """
        param = self.model.logit_scale
        if param is None:
            return False
        fixed = self.loss_fn.fixed_logit_scale()
        if fixed is None:
            param.requires_grad_(False)
            return False
        if not self.model.logit_scale_pretrained:
            with torch.no_grad():
                param.fill_(math.log(fixed))
        return True

    def _decoding(self) -> TargetDecoding | None:
        decoding = build_decoding(self.config.decoding, embed_dim=self.model.embed_dim, vocab=self.vocab)
        if decoding is None:
            return None
        decoding.to(self.device)
        if decoding.kind == "ltd":
            cache_dir = self.config.data.cache_dir or str(_default_cache_dir(self.train_data))
            path = Path(cache_dir) / f"ltd-targets-{self.train_data.fingerprint[:16]}.npy"
            self.targets = compute_latent_targets(self.train_data.captions, path, progress=self.progress)
        return decoding

    def _optimizer(self) -> torch.optim.Optimizer:
        ocfg = self.config.optim
        params = [p for p in self.model.encoder_parameters() if p.requires_grad]
        if self.decoding is not None:
            params += [p for p in self.decoding.decoder_parameters() if p.requires_grad]
        groups: list[dict[str, Any]] = [{"params": params}] if params else []
        if self.learns_logit_scale:
            # no weight decay: it would pull the temperature towards 1
            groups.append({"params": [self.model.logit_scale], "weight_decay": 0.0})
        if not groups:
            raise ValueError(
                "nothing to train: every tower is frozen and there is no decoder or learned logit scale; "
                "set model.image.finetune or model.text.finetune to true"
            )
        cls = torch.optim.AdamW if ocfg.optimizer == "adamw" else torch.optim.Adam
        return cls(groups, lr=ocfg.lr, weight_decay=ocfg.weight_decay)

    # --- batches ----------------------------------------------------------------------------
    def _local_slice(self, plan: PlannedBatch) -> PlannedBatch:
        """This process's share of a global batch, in an order that gathers back to the global one."""
        world, r = dist.world_size(), dist.rank()
        if world == 1:
            return plan
        if self.loss_fn.sampling == "caption":
            n = len(plan.cap_idx) // world
            return PlannedBatch(plan.img_idx[r * n : (r + 1) * n], plan.cap_idx[r * n : (r + 1) * n])
        n = len(plan.img_idx) // world
        imgs = plan.img_idx[r * n : (r + 1) * n]
        keep = np.isin(self.train_data.img_of_cap[plan.cap_idx], imgs)
        return PlannedBatch(imgs, plan.cap_idx[keep])

    def _make_batch(self, plan: PlannedBatch, epoch: int, step: int) -> dict[str, Any]:
        data = self.train_data
        # one generator per sample from its position: augmentation is the same after a resume
        images = self.train_transform.stack(
            [data.get_image(int(i)) for i in plan.img_idx],
            lambda j: np.random.default_rng([self.seed, epoch, step, j]),
        )  # (Ni, 3, H, W) or (Ni, R, F)
        captions = [data.captions[int(c)] for c in plan.cap_idx]
        batch = {
            "images": images,
            "text": self.model.tokenize(captions),
            "img_ids": torch.from_numpy(plan.img_idx.astype(np.int64)),
            "cap_img_ids": torch.from_numpy(data.img_of_cap[plan.cap_idx].astype(np.int64)),
            "cap_ids": torch.from_numpy(plan.cap_idx.astype(np.int64)),
        }
        if self.decoding is not None:
            batch["target"] = (
                torch.from_numpy(self.targets[plan.cap_idx])
                if self.decoding.kind == "ltd"
                else self.decoding.encode_captions(captions)
            )
        return batch

    def _batches(self, plans: list[PlannedBatch], epoch: int, start: int) -> Iterator[dict[str, Any]]:
        workers = self.config.train.workers
        if workers == 0:
            for k in range(start, len(plans)):
                yield self._make_batch(self._local_slice(plans[k]), epoch, k)
            return

        def make(k: int) -> dict[str, Any]:
            return self._make_batch(self._local_slice(plans[k]), epoch, k)

        # A list is a map-style dataset at run time (__getitem__ and __len__); torch types it as the
        # Dataset class, not a protocol.
        steps = cast("torch.utils.data.Dataset[int]", list(range(start, len(plans))))
        loader = torch.utils.data.DataLoader(
            steps,
            batch_size=None,
            num_workers=workers,
            # batch_size=None: collate_fn gets one step number, not the list torch's annotation expects
            collate_fn=make,  # type: ignore[arg-type]
        )
        yield from loader

    # --- one step ---------------------------------------------------------------------------
    def _step(self, batch: dict[str, Any], lr: float) -> dict[str, float]:
        dev = self.device
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        autocast = torch.autocast("cuda", dtype=self.amp_dtype) if self.amp_dtype else nullcontext()
        with autocast:
            img = self.model.encode_image(batch["images"].to(dev, non_blocking=True))  # (Ni, D)
            cap = self.model.encode_text({k: v.to(dev) for k, v in batch["text"].items()})  # (Nc, D)
        img_all, cap_all = dist.all_gather_with_grad(img), dist.all_gather_with_grad(cap)
        img_ids = dist.all_gather_nograd(batch["img_ids"].to(dev))
        cap_img_ids = dist.all_gather_nograd(batch["cap_img_ids"].to(dev))
        relevant = None
        if self.pair_truth is not None:  # the global batch's truth, the same on every process
            cap_ids = dist.all_gather_nograd(batch["cap_ids"].to(dev))
            relevant = torch.from_numpy(self.pair_truth(img_ids.cpu().numpy(), cap_ids.cpu().numpy())).to(dev)
        scale = self.model.logit_multiplier() if self.learns_logit_scale else None  # ()
        # passed only when learned: without one the objective is called exactly as before
        learned = {"logit_scale": scale} if scale is not None else {}
        terms = self.loss_fn(img_all, cap_all, img_ids, cap_img_ids, relevant, **learned)
        total = terms["loss"]
        logged = {f"loss/{k}": v for k, v in terms.items() if k != "loss"}
        if scale is not None:
            logged["logit_scale"] = scale
        if self.decoding is not None:
            target = batch["target"]
            target = (
                {k: dist.all_gather_nograd(v.to(dev)) for k, v in target.items()}
                if isinstance(target, dict)
                else dist.all_gather_nograd(target.to(dev))
            )
            dec_loss, dec_logged = self.decoding(cap_all, target)
            total = total + dec_loss
            logged.update(dec_logged)
        self.optimizer.zero_grad(set_to_none=True)
        if self.decoding is not None:
            self.decoding.zero_multiplier_grad()
        self.scaler.scale(total).backward()
        # encoder gradients: each process holds its own rows' share; decoder and logit-scale gradients
        # are complete (every process computes the same global loss from the gathered rows)
        dist.sum_gradients(self.model.encoder_parameters())
        self.scaler.unscale_(self.optimizer)
        clip = self.config.optim.grad_clip
        if clip > 0:
            nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], clip)
        self.scaler.step(self.optimizer)
        if self.decoding is not None:
            self.decoding.step_multiplier()
        self.scaler.update()
        logged["loss"] = total
        return {k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in logged.items()}

    # --- the loop ---------------------------------------------------------------------------
    def fit(self) -> dict[str, Any]:
        tcfg = self.config.train
        epochs, max_steps = tcfg.epochs, tcfg.max_steps
        log_every, save_every = tcfg.log_every, tcfg.save_every
        if dist.is_main():
            self.out.mkdir(parents=True, exist_ok=True)
        self.model.train()
        started, samples, stopped_early = time.perf_counter(), 0, False
        first_epoch = self.state.epoch  # > 0 when resumed

        while self.state.epoch < epochs and not self._out_of_patience():
            epoch = self.state.epoch
            plans = plan_epoch(self.train_data, self.loss_fn.sampling, self.batch_size, self.seed, epoch)
            if not plans:
                raise ValueError(
                    f"train.batch_size={self.batch_size} is larger than the training split "
                    f"({len(self.train_data.captions)} captions); lower it"
                )
            self.loss_fn.on_epoch_start(epoch)
            swa_from = len(plans) - max(1, int(len(plans) * tcfg.swa_fraction))
            swa_every = max(1, (len(plans) - swa_from) // tcfg.swa_snapshots)
            bar = tqdm(
                total=len(plans),
                initial=self.state.step_in_epoch,
                desc=f"epoch {epoch + 1}/{epochs}",
                unit="step",
                disable=not self.progress,
                leave=False,
            )
            window_start, window_samples = time.perf_counter(), 0
            for k, batch in enumerate(
                self._batches(plans, epoch, self.state.step_in_epoch), start=self.state.step_in_epoch
            ):
                lr = learning_rate(
                    self.config.optim,
                    epochs,
                    epoch,
                    self.state.global_step,
                    max_steps or epochs * len(plans),
                )
                logged = self._step(batch, lr)
                self.state.global_step += 1
                self.state.step_in_epoch = k + 1
                n = len(plans[k].cap_idx)
                samples, window_samples = samples + n, window_samples + n
                if tcfg.swa and k >= swa_from and (k - swa_from) % swa_every == 0:
                    self._swa_update()
                if not math.isfinite(logged["loss"]):
                    raise FloatingPointError(
                        f"loss became {logged['loss']} at step {self.state.global_step}; lower optim.lr or "
                        "check the data (train_state.pt keeps the last good state)"
                    )
                bar.update(1)
                bar.set_postfix(loss=f"{logged['loss']:.4f}")
                if self.state.global_step % log_every == 0:
                    now = time.perf_counter()
                    self._log(
                        {
                            "event": "train",
                            "epoch": epoch,
                            "step": self.state.global_step,
                            "lr": lr,
                            "samples_per_s": window_samples / max(now - window_start, 1e-9),
                            **logged,
                        }
                    )
                    window_start, window_samples = now, 0
                if self.state.global_step % save_every == 0:
                    self.save_state()
                if max_steps and self.state.global_step >= max_steps:
                    stopped_early = self.state.step_in_epoch < len(plans)
                    break
            bar.close()
            if stopped_early:
                break
            self._end_epoch(epoch)
            if max_steps and self.state.global_step >= max_steps:
                break
        self.save_state()
        if dist.is_main():
            self._save_checkpoint("last")
        elapsed = time.perf_counter() - started
        return {
            "out": str(self.out),
            "steps": self.state.global_step,
            "epochs_completed": self.state.epoch,
            "epochs_this_call": self.state.epoch - first_epoch,  # fewer than completed when resumed
            "best_rsum": self.state.best_rsum if self.state.best_epoch >= 0 else None,
            "best_epoch": self.state.best_epoch + 1 if self.state.best_epoch >= 0 else None,
            "stopped_by_patience": self._out_of_patience(),
            "samples_per_s": round(samples / elapsed, 1) if elapsed > 0 else None,
            "elapsed_s": round(elapsed, 1),
            "peak_rss_mb": round(peak_rss_mb(), 1),
        }

    def _end_epoch(self, epoch: int) -> None:
        if self.swa is not None:
            # LTD setting: the next epoch and validation start from the averaged weights
            self.model.load_state_dict(self.swa.module.state_dict())
            self.swa = None
        self.state.epoch, self.state.step_in_epoch = epoch + 1, 0
        val_every = self.config.train.val_every
        last = epoch + 1 == self.config.train.epochs
        if val_every > 0 and ((epoch + 1) % val_every == 0 or last) and dist.is_main():
            metrics = self.validate()
            self.state.history.append({"epoch": epoch + 1, **metrics})
            self._log({"event": "val", "epoch": epoch + 1, "step": self.state.global_step, **metrics})
            if metrics["rsum"] > self.state.best_rsum:
                self.state.best_rsum, self.state.best_epoch = metrics["rsum"], epoch
                self._save_checkpoint("best", metrics)
            if self.progress:
                tqdm.write(
                    f"epoch {epoch + 1}: val rsum {metrics['rsum']:.2f} "
                    f"(best {self.state.best_rsum:.2f} at epoch {self.state.best_epoch + 1})"
                )
        dist.barrier()
        self.save_state()

    def _out_of_patience(self) -> bool:
        """``train.patience`` epochs have passed since validation rsum last improved, and at least
        ``train.min_epochs`` have run."""
        patience = self.config.train.patience
        # every process knows both from the config and the shared epoch: no collective needed
        if patience <= 0 or self.state.epoch < self.config.train.min_epochs:
            return False
        best = self.state.best_epoch  # validation runs on rank 0 only: it decides for all
        return dist.main_decides(best >= 0 and self.state.epoch - (best + 1) >= patience)

    def _swa_update(self) -> None:
        if self.swa is None:
            self.swa = torch.optim.swa_utils.AveragedModel(self.model)
        self.swa.update_parameters(self.model)  # the first call copies, later ones average

    def validate(self) -> dict[str, float]:
        assert self.val_data is not None
        img = embed_images(self.model, self.val_data, device=self.device)
        cap = embed_captions(self.model, self.val_data.captions, device=self.device)
        return {k: round(v, 4) for k, v in evaluate_embeddings(img, cap, self.val_data.img_of_cap).items()}

    # --- persistence ------------------------------------------------------------------------
    def _log(self, record: dict[str, Any]) -> None:
        if dist.is_main():
            with open(self.out / METRICS_FILE, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def checkpoint_meta(self, metrics: dict[str, float] | None = None) -> dict[str, Any]:
        return {
            "objective": {
                "name": self.loss_fn.name,
                "params": self.loss_fn.params(),
                **self._learned_scale_meta(),
            },
            "decoding": self.config.decoding,
            "data": {
                "path": str(self.train_data.source),
                "kind": self.train_data.kind,
                "train_split": self.train_data.name,
                "fingerprint": self.train_data.fingerprint,
            },
            "step": self.state.global_step,
            "epoch": self.state.epoch,
            "val_metrics": metrics,
            "train_config": self.config.as_dict(),
        }

    def _learned_scale_meta(self) -> dict[str, float]:
        """The learned factor that replaced the objective's temperature (or scale), for the record."""
        scale = self.model.logit_multiplier() if self.learns_logit_scale else None
        return {} if scale is None else {"learned_logit_scale": round(float(scale.detach()), 6)}

    def _save_checkpoint(self, name: str, metrics: dict[str, float] | None = None) -> None:
        save_checkpoint(self.out / name, self.model, self.checkpoint_meta(metrics))

    def save_state(self) -> None:
        """Everything a resume needs (``training.run_state``), written by the main process."""
        if not dist.is_main():
            return
        modules = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "decoding": self.decoding.state_dict() if self.decoding is not None else None,
            "swa": self.swa.state_dict() if self.swa is not None else None,
        }
        write_state(self.out / STATE_FILE, self.config, self.state, modules)

    def load_state(self) -> bool:
        """Restore ``train_state.pt`` from ``train.out`` if there is one; returns whether it did."""
        restored = read_state(self.out / STATE_FILE, self.config, self.device)
        if restored is None:
            return False
        self.state, modules = restored
        self.model.load_state_dict(modules["model"])
        self.optimizer.load_state_dict(modules["optimizer"])
        self.scaler.load_state_dict(modules["scaler"])
        if self.decoding is not None:
            self.decoding.load_state_dict(modules["decoding"])
        if modules["swa"] is not None:
            self.swa = torch.optim.swa_utils.AveragedModel(self.model)
            self.swa.load_state_dict(modules["swa"])
        return True


def _default_cache_dir(data: SplitData) -> Path:
    base = data.source if data.source.is_dir() else data.source.parent
    return base / ".icr-cache"


def train(config: TrainConfig, *, resume: bool = False, progress: bool = True) -> dict[str, Any] | None:
    """Train one model from its config (``training.config.load_config``); the summary (None off rank 0)."""
    # the backend follows train.device, not the hardware: CPU processes on a GPU machine use gloo
    cuda = resolve_device(config.train.device, "train.device") == "cuda"
    started = dist.init_from_env(backend="nccl" if cuda else "gloo")
    try:
        trainer = Trainer(config, progress=progress)
        state_file = trainer.out / STATE_FILE
        if resume:
            if not trainer.load_state():
                raise FileNotFoundError(f"--resume: no {STATE_FILE} in {trainer.out}; run without --resume")
        elif state_file.exists():
            raise FileExistsError(
                f"{trainer.out} already holds a run ({STATE_FILE}); pass --resume to "
                "continue it, or set a new train.out"
            )
        summary = trainer.fit()
        # both ranks reach the teardown together: gloo aborts a rank (SIGABRT, "terminate called
        # without an active exception") whose peer destroys the group while it still talks to it
        dist.barrier()
        return summary if dist.is_main() else None  # evaluated before the process group goes away
    finally:
        if started:
            dist.cleanup()
