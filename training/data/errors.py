"""The one error type raised for bad or missing dataset files.

Dataset problems are user errors (wrong folder, truncated download, hand-edited JSON), so the
message has to be enough to fix them without a debugger: it names the file, the line when there
is one, and says what to do.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A dataset file is missing, unreadable or does not follow its format.

    ``str(err)`` reads ``"<file>[:line[:col]]: <what is wrong> <how to fix it>"``. The parts are
    also kept as attributes (``path``, ``line``, ``column``, ``detail``, ``hint``) so callers such
    as the HTTP service can report them in structured form.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        line: int | None = None,
        column: int | None = None,
        hint: str | None = None,
    ) -> None:
        self.detail = message
        self.path = Path(path) if path is not None else None
        self.line = line
        self.column = column
        self.hint = hint
        super().__init__(self._format())

    def _format(self) -> str:
        text = self.detail
        if self.path is not None:
            location = str(self.path)
            if self.line is not None:
                location += f":{self.line}"
                if self.column is not None:
                    location += f":{self.column}"
            text = f"{location}: {text}"
        if self.hint:
            # A multi-line detail (a list of files) ends with a newline: start the hint on its own line.
            text = f"{text}{'' if text.endswith(chr(10)) else ' '}{self.hint}"
        return text

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # The default pickling calls cls(*self.args) with the *formatted* message, which would
        # lose the keyword parts and prefix the location twice (e.g. across multiprocessing).
        rebuild = functools.partial(
            type(self), path=self.path, line=self.line, column=self.column, hint=self.hint
        )
        return (rebuild, (self.detail,))


def line_of(text: str, needle: str) -> int | None:
    """1-based line number of the first occurrence of ``needle`` in ``text``; None if absent.

    Used to point an error at the line of a JSON entry: the json module parses to plain
    dicts and keeps no positions, so the entry's line is recovered from a unique string in it.
    """
    index = text.find(needle)
    if index < 0:
        return None
    return text.count("\n", 0, index) + 1


def read_text(path: Path, what: str, hint: str) -> str:
    """UTF-8 text of a dataset file (a BOM is tolerated); DatasetError naming the file otherwise.

    ``what`` names the file for the user ("dataset JSON", "caption file"); ``hint`` says how to
    get a good copy.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DatasetError(f"{what} not found.", path=path, hint=hint) from None
    except OSError as err:
        raise DatasetError(f"cannot read {what}: {err.strerror}.", path=path, hint=hint) from None
    try:
        return raw.decode("utf-8-sig")  # -sig: tolerate a BOM written by some editors
    except UnicodeDecodeError as err:
        raise DatasetError(
            f"{what} is not UTF-8 text ({err.reason} at byte {err.start}).",
            path=path,
            line=raw.count(b"\n", 0, err.start) + 1,
            hint=hint,
        ) from None


def parse_json(text: str, path: Path, what: str, hint: str) -> Any:
    """``json.loads`` with a DatasetError at file:line:column on malformed input."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise DatasetError(
            f"{what} is malformed JSON: {err.msg}.", path=path, line=err.lineno, column=err.colno, hint=hint
        ) from None
