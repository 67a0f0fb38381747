"""Shared behaviour of the `icr` commands: user errors print one message, not a traceback."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

# Errors that mean "the input is wrong": the message says how to fix it, a traceback would not help.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, FileExistsError, FileNotFoundError)


def fail_cleanly(fn: F) -> F:
    """Turn user errors into `error: ...` on stderr and exit status 2 (ICR_DEBUG=1: the traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as e:
            if os.environ.get("ICR_DEBUG"):
                raise
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


def print_summary(result: dict[str, Any], indent: int = 0) -> None:
    """Nested dict as an indented, aligned listing (readable in a terminal and in CI logs)."""
    width = max((len(str(k)) for k in result), default=0)
    for key, value in result.items():
        if isinstance(value, dict):
            typer.echo(f"{' ' * indent}{key}:")
            print_summary(value, indent + 2)
        else:
            typer.echo(f"{' ' * indent}{str(key).ljust(width)}  {value}")
