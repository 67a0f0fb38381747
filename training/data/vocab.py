"""Word tokenizer and vocabulary for the GRU/transformer caption towers.

Specials follow VSE++ (``<pad>=0, <start>=1, <end>=2, <unk>=3``) so padded batches and
checkpoints keep the ids every seed implementation uses. The tokenizer is a regex rather than
``nltk.word_tokenize``: nltk needs a separate data download, which is impossible offline.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from icr.core.atomic import atomic_write_text
from icr.training.data.errors import DatasetError, parse_json, read_text

if TYPE_CHECKING:  # imported for annotations only: karpathy imports tokenize from here
    from icr.training.data.karpathy import CaptionSplit, KarpathyDataset
    from icr.training.data.precomp import PrecompSplit
    from icr.training.data.training_data import SplitData

VOCAB_FORMAT_VERSION = 1

# A word is a run of letters/digits, optionally joined by internal apostrophes ("it's",
# "o'clock"). Everything else (punctuation, hyphens, underscores) separates words, which is what
# Karpathy's pre-computed "tokens" look like.
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
# Typographic apostrophes would otherwise split "it’s" differently from "it's".
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})


def tokenize(text: str) -> list[str]:
    """Lower-cased word tokens of ``text``; punctuation is dropped.

    >>> tokenize("A dog's ball, it's RED!")
    ['a', "dog's", 'ball', "it's", 'red']
    """
    return _WORD.findall(text.lower().translate(_APOSTROPHES))


class Vocabulary:
    """Bidirectional word <-> id map with the four VSE++ specials at ids 0-3."""

    PAD, START, END, UNK = 0, 1, 2, 3
    SPECIALS: tuple[str, ...] = ("<pad>", "<start>", "<end>", "<unk>")

    def __init__(self, words: Iterable[str] = ()) -> None:
        """``words`` are the non-special words in id order (ids start at 4)."""
        itos = list(self.SPECIALS)
        stoi = {word: i for i, word in enumerate(itos)}
        for word in words:
            if not isinstance(word, str) or not word:
                raise ValueError(f"vocabulary words must be non-empty strings, got {word!r}")
            if word in stoi:
                raise ValueError(f"duplicate or reserved vocabulary word {word!r}")
            stoi[word] = len(itos)
            itos.append(word)
        self._itos: tuple[str, ...] = tuple(itos)
        self._stoi: dict[str, int] = stoi

    @classmethod
    def build(cls, token_lists: Iterable[Sequence[str]], min_count: int = 1) -> Vocabulary:
        """Vocabulary of the words occurring at least ``min_count`` times.

        Ordered by descending count, ties alphabetically, so the same captions always give the
        same ids (a checkpoint's embedding rows depend on them).
        """
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}")
        counts: Counter[str] = Counter()
        for tokens in token_lists:
            counts.update(tokens)
        for special in cls.SPECIALS:
            counts.pop(special, None)  # a literal "<unk>" in a caption must not get a second id
        kept = [w for w, n in counts.items() if n >= min_count and w]
        kept.sort(key=lambda w: (-counts[w], w))
        return cls(kept)

    @property
    def itos(self) -> tuple[str, ...]:
        """All tokens in id order, specials first."""
        return self._itos

    def __len__(self) -> int:
        return len(self._itos)

    def __contains__(self, word: object) -> bool:
        return word in self._stoi

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Vocabulary):
            return NotImplemented
        return self._itos == other._itos

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} tokens)"

    def id_of(self, word: str) -> int:
        """Id of ``word``; ``<unk>`` for words not in the vocabulary."""
        return self._stoi.get(word, self.UNK)

    def encode(self, text_or_tokens: str | Sequence[str], add_special: bool = True) -> list[int]:
        """Ids of a caption. A string is tokenized first; a token list is used as given.

        With ``add_special`` the ids are wrapped in ``<start> ... <end>`` as the VSE++ text
        encoders expect.
        """
        tokens = tokenize(text_or_tokens) if isinstance(text_or_tokens, str) else text_or_tokens
        ids = [self._stoi.get(t, self.UNK) for t in tokens]
        if add_special:
            ids = [self.START, *ids, self.END]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Words of ``ids`` joined by spaces; stops at ``<end>``, skips ``<pad>`` and ``<start>``.

        Unknown words come back as ``<unk>`` (the original word is not recoverable).
        """
        words: list[str] = []
        for raw in ids:
            i = int(raw)
            if not 0 <= i < len(self._itos):
                raise IndexError(f"token id {i} out of range for a vocabulary of {len(self)}")
            if i == self.END:
                break
            if i in (self.PAD, self.START):
                continue
            words.append(self._itos[i])
        return " ".join(words)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": VOCAB_FORMAT_VERSION,
            "specials": list(self.SPECIALS),
            "words": list(self._itos[len(self.SPECIALS) :]),
        }

    @classmethod
    def from_dict(cls, data: Any) -> Vocabulary:
        """Inverse of :meth:`to_dict`; ValueError describing the problem if ``data`` is not one."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        version = data.get("format_version")
        if version != VOCAB_FORMAT_VERSION:
            raise ValueError(
                f"unsupported vocabulary format_version {version!r} "
                f"(this code reads version {VOCAB_FORMAT_VERSION})"
            )
        specials = data.get("specials", list(cls.SPECIALS))
        if list(specials) != list(cls.SPECIALS):
            # Different special ids would silently shift every padded batch.
            raise ValueError(f"specials {specials!r} differ from the expected {list(cls.SPECIALS)!r}")
        words = data.get("words")
        if not isinstance(words, list):
            raise ValueError('missing "words" list')
        return cls(words)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the vocabulary as JSON, atomically, and return the path.

        Written to a temporary file in the same folder and then renamed, so a crash mid-write
        never leaves a truncated vocabulary next to a checkpoint that depends on it.
        """
        text = json.dumps(self.to_dict(), ensure_ascii=False, indent=0) + "\n"
        return atomic_write_text(path, text)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Vocabulary:
        """Read a vocabulary written by :meth:`save`; DatasetError naming the file if it is bad."""
        path = Path(path)
        hint = "Rebuild it from the training split (build_training_vocab) and save it again."
        data = parse_json(read_text(path, "vocabulary file", hint), path, "vocabulary file", hint)
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise DatasetError(f"not a vocabulary file: {err}.", path=path, hint=hint) from None


def build_vocab_from_split(split: CaptionSplit | PrecompSplit | SplitData, min_count: int = 1) -> Vocabulary:
    """Vocabulary of one split's captions (Karpathy tokens, or tokenized precomp captions)."""
    return Vocabulary.build(split.caption_tokens, min_count=min_count)


def build_training_vocab(dataset: KarpathyDataset, min_count: int = 1) -> Vocabulary:
    """Vocabulary of the *train* split only (which includes COCO restval when it was folded).

    Words that occur only in val/test captions must map to ``<unk>``: giving them their own
    ids leaks the evaluation captions into the model and inflates test recall. The original
    VSE++ code built its vocabulary from all splits and was corrected for exactly this
    (fartashf/vsepp issue #29).
    """
    return build_vocab_from_split(dataset.split("train"), min_count=min_count)
