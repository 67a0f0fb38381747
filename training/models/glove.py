"""Initialising word embeddings from a GloVe text file (LTD initialises its GRU tower this way)."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import torch
from torch import Tensor

from icr.training.data.vocab import Vocabulary

_HINT = "set model.text.glove_path to a GloVe .txt(.gz) file (one 'word v1 ... vD' per line) or to null"


def load_glove(path: str | os.PathLike[str], vocab: Vocabulary, dim: int) -> tuple[Tensor, float]:
    """(``(len(vocab), dim)`` embedding matrix, coverage).

    Rows start as U(-0.1, 0.1) (the VSE++ init, drawn from torch's global RNG); the row of every
    vocabulary word found in the file is replaced by its GloVe vector. An exact match wins over a
    lower-cased one (GloVe 840B is cased, our vocabulary is lower-cased). ``coverage`` is the
    fraction of non-special vocabulary words that got a vector.

    Only the vectors of vocabulary words are parsed, so a 5 GB file costs one pass of reading.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: GloVe file not found; {_HINT}")
    weights = torch.empty(len(vocab), dim).uniform_(-0.1, 0.1)  # (V, D)
    exact: set[int] = set()
    lowered: set[int] = set()
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as handle:
            for lineno, line in enumerate(handle, start=1):
                word, _, rest = line.rstrip("\n").partition(" ")
                if lineno == 1:
                    n_values = len(rest.split())
                    if n_values == 1 and word.isdigit():
                        # word2vec-style header "count dim": check the dim and read on.
                        n_values = int(rest)
                        if n_values != dim:
                            raise ValueError(
                                f"{path}: vectors are {n_values}-d but model.text.word_dim is {dim}"
                            )
                        continue
                    if n_values != dim:
                        raise ValueError(
                            f"{path}: vectors are {n_values}-d but model.text.word_dim is {dim}; "
                            f"set model.text.word_dim to {n_values} or use a {dim}-d GloVe file"
                        )
                if word in vocab:
                    i, is_exact = vocab.id_of(word), True
                    if i in exact:
                        continue
                elif word.lower() in vocab:
                    i, is_exact = vocab.id_of(word.lower()), False
                    if i in exact or i in lowered:  # the first lower-cased match is kept
                        continue
                else:
                    continue
                values = rest.split()
                if len(values) != dim:  # GloVe 840B has a few "words" containing spaces: skip them
                    continue
                try:
                    weights[i] = torch.tensor([float(v) for v in values])
                except ValueError:
                    continue
                (exact if is_exact else lowered).add(i)
    except (OSError, EOFError, UnicodeError) as err:
        raise ValueError(f"{path}: cannot read the GloVe file ({err}); {_HINT}") from None
    n_words = len(vocab) - len(Vocabulary.SPECIALS)
    found = {i for i in exact | lowered if i >= len(Vocabulary.SPECIALS)}
    return weights, (len(found) / n_words if n_words else 0.0)
