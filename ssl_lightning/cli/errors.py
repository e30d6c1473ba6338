"""Readable command-line errors: parser messages without jsonargparse's Union boilerplate, the
closest names for an unknown ``class_path``, and a constructor's own exception instead of the
traceback of the parser that called it.

Set ``JSONARGPARSE_DEBUG=1`` to get the full tracebacks back.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import pytorch_lightning as pl
from lightning_fabric.utilities.exceptions import MisconfigurationException
from pytorch_lightning.cli import LightningArgumentParser
from torch import nn


class CLIError(Exception):
    """An error the CLI prints as ``error: <message>`` (no traceback) before exiting with 1."""


def debug_mode() -> bool:
    """``JSONARGPARSE_DEBUG`` is set: keep full tracebacks."""
    return os.environ.get("JSONARGPARSE_DEBUG", "").lower() not in ("", "0", "false")


# ------------------------------------------------------------------ unknown class_path names
def _public_classes(base: type) -> list[str]:
    """The public ``ssl_lightning`` classes deriving from ``base``, without the base classes."""
    import ssl_lightning
    from ssl_lightning.data import SSLDataModule
    from ssl_lightning.methods import MomentumMethod, SSLMethod

    abstract = (SSLMethod, MomentumMethod, SSLDataModule)
    found = [getattr(ssl_lightning, name) for name in ssl_lightning.__all__]
    return sorted((c.__name__ for c in found if isinstance(c, type) and issubclass(c, base)
                   and c not in abstract), key=str.lower)


def _backbones() -> list[str]:
    import ssl_lightning.backbones as backbones

    return [f"ssl_lightning.{n}" for n in backbones.__all__
            if isinstance(getattr(backbones, n), type)
            and issubclass(getattr(backbones, n), nn.Module)]


def _lightning_callbacks() -> list[str]:
    import pytorch_lightning.callbacks as callbacks

    return [f"pytorch_lightning.callbacks.{n}" for n in callbacks.__all__ if n != "Callback"]


#: Parser key (its last part) -> (what the names are, listed names, more names to match, hint).
_KINDS: dict[str, tuple[str, Callable[[], list[str]], Callable[[], list[str]], str]] = {
    "model": ("methods", lambda: _public_classes(pl.LightningModule), list,
              "or the import path of any LightningModule"),
    "data": ("data modules", lambda: _public_classes(pl.LightningDataModule), list,
             "or the import path of any LightningDataModule"),
    "backbone": ("backbones", _backbones, list,
                 "or a torchvision model such as torchvision.models.resnet50, or the import "
                 "path of any nn.Module"),
    "callbacks": ("callbacks", lambda: _public_classes(pl.Callback), _lightning_callbacks,
                  "or pytorch_lightning.callbacks.<Name>, or the import path of any Callback"),
}


def unknown_class_message(key: str, name: str) -> str:
    """``key``'s class ``name`` does not exist: the closest name and the available ones."""
    label, listed, more, hint = _KINDS.get(key.rsplit(".", 1)[-1], _KINDS["model"])
    names = listed()
    by_short = {n.rsplit(".", 1)[-1].lower(): n for n in [*more(), *names]}
    close = difflib.get_close_matches(name.rsplit(".", 1)[-1].lower(), list(by_short), n=1,
                                      cutoff=0.5)
    suggestion = f" Did you mean {by_short[close[0]]!r}?" if close else ""
    return (f"--{key}: unknown class {name!r}.{suggestion} Available {label}: "
            f"{', '.join(names)}; {hint}.")


_UNKNOWN_CLASS = (
    re.compile(r"Expected a dot import path string: (\S+)"),
    re.compile(r"module '([\w.]+)' has no attribute '(\w+)'"),
)
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)"')


def _unknown_class(message: str) -> str | None:
    for pattern in _UNKNOWN_CLASS:
        match = pattern.search(message)
        if match:
            name = ".".join(match.groups())
            keys = _PARSER_KEY.findall(message[: match.start()])
            return unknown_class_message(".".join(keys) or "model", name)
    return None


# ------------------------------------------------------------------------ parser messages
_BOILERPLATE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:",
                "Given value type:", "Expected a <class 'NoneType'>", "Expected a path but",
                "Problem with given class_path", "Parser key")


def clean_parser_message(message: str) -> str:
    """A jsonargparse message without the Union and ``Given value: Namespace(...)`` noise."""
    unknown = _unknown_class(message)
    if unknown is not None:
        return unknown
    lines: list[str] = []
    for line in message.splitlines():
        text = line.strip().removeprefix("- ")
        if not text or text.startswith(_BOILERPLATE) or text in lines:
            continue
        if text.startswith("Given value:") and ("Namespace(" in text or "NestedArg(" in text
                                                or len(text) > 120):
            continue
        lines.append(text)
    keys = _PARSER_KEY.findall(message)
    return f"--{'.'.join(keys)}: {' '.join(lines)}" if keys else " ".join(lines)


class ReadableArgumentParser(LightningArgumentParser):
    """Prints ``error: <short message>`` and a pointer to ``--help`` instead of the full usage
    and jsonargparse's nested Union report."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or debug_mode():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {clean_parser_message(message)}\n"
                         f"(all options: {prog} --help)\n")
        self.exit(2)


# -------------------------------------------------------------------- constructor errors
#: Exceptions shown as their message only: the validation errors of constructors and the
#: trainer (others keep their traceback, from the constructor, without jsonargparse's frames).
READABLE = (ValueError, TypeError, OSError, MisconfigurationException)


def constructor_error(err: BaseException) -> BaseException:
    """The exception a constructor raised, unwrapped from jsonargparse's re-raises: the
    outermost one of the chain that was not raised inside jsonargparse (``err`` itself if none
    is), so a constructor's own message wins over the low-level error it was raised from."""
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    for exc in chain:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames and "jsonargparse" not in frames[-1].filename:
            return exc
    return err
