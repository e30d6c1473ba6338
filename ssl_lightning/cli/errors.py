"""Readable command-line errors: parser messages without jsonargparse's Union boilerplate, the
closest names for an unknown ``class_path`` and for an unknown argument, a constructor's own
exception instead of the traceback of the parser that called it, and the message of a setting
refused while a subcommand sets up (see :func:`run_error_message`).

Set ``JSONARGPARSE_DEBUG=true`` to get the full tracebacks back.
"""

from __future__ import annotations

import builtins
import difflib
import importlib
import os
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from jsonargparse import ArgumentParser
from torch import nn
from torch.multiprocessing.spawn import ProcessRaisedException

from ssl_lightning._lightning import (
    PACKAGE,
    LightningArgumentParser,
    MisconfigurationException,
    pl,
    training_epoch_loop,
)
from ssl_lightning._lightning import callbacks as lightning_callbacks
from ssl_lightning.cli.help import ModuleHelpFormatter


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
    return [f"{PACKAGE}.callbacks.{n}" for n in lightning_callbacks.__all__ if n != "Callback"]


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
                  f"or {PACKAGE}.callbacks.<Name>, or the import path of any Callback"),
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
#: The key jsonargparse puts before a line's own message (``Parser key "config": File ...``).
_PARSER_KEY_PREFIX = re.compile(r'^Parser key "[\w.]+":\s*')


def _unknown_class(message: str) -> str | None:
    for pattern in _UNKNOWN_CLASS:
        match = pattern.search(message)
        if match:
            name = ".".join(match.groups())
            keys = _PARSER_KEY.findall(message[: match.start()])
            return unknown_class_message(".".join(keys) or "model", name)
    return None


# ------------------------------------------------------- LightningCLI's automatic options
#: ``--optimizer`` / ``--lr_scheduler`` (or a config's top-level ``optimizer:``) in a parser
#: message: LightningCLI's automatic options, which this CLI does not add.
_AUTOMATIC_OPTION = re.compile(r"(?:unrecognized arguments:(?:.*\s)?|does not accept option ')"
                               r"(?:--)?(optimizer|lr_scheduler)\b")


def automatic_option_message(option: str) -> str:
    """Why ``--optimizer`` / ``--lr_scheduler`` do not exist and what sets the optimiser."""
    return (f"--{option}: there is no --optimizer or --lr_scheduler option (LightningCLI's "
            "automatic one would replace the method's own optimiser and schedule: LARS / SGD / "
            "AdamW, linear warm-up + cosine decay, lr scaled to the global batch). Choose the "
            "optimiser with --model.init_args.optimizer (or --model.optimizer) lars|sgd|adamw "
            "and the schedule with --model.lr, --model.weight_decay, --model.warmup_epochs and "
            "--model.final_lr_ratio.")


# ------------------------------------------------------------------ unknown argument names
#: A class's unknown argument (command line or config): ``Problem with given class_path 'X':
#: ... Option 'name' is not accepted``, the class being the last one named before the option.
_NOT_ACCEPTED = re.compile(r"Problem with given class_path '([\w.]+)':\s*"
                           r"(?:Parser key.*\s*)*Option '(\w+)' is not accepted")
#: An unknown option of the parser itself: on the command line, or a key of a config.
_UNKNOWN_OPTION = re.compile(r"(?:unrecognized arguments: --|does not accept option ')([\w.]+)")


def suggestion_message(where: str, kind: str, name: str, names: list[str], owner: str) -> str:
    """``name`` is not one of ``names``: the closest one (difflib) and all of them."""
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    suggestion = f" Did you mean {close[0]!r}?" if close else ""
    return (f"{where}unknown {kind} {name!r}.{suggestion} "
            f"{kind.capitalize()}s of {owner}: {', '.join(names)}.")


def class_arguments(class_path: str) -> list[str]:
    """The constructor arguments of ``class_path`` that the CLI accepts (those its ``**kwargs``
    pass on to a parent class included), as jsonargparse resolves them; the deprecated old
    names of renamed arguments (``renamed_arguments``) left out."""
    module, _, name = class_path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, fail_untyped=False, sub_configs=True)
    deprecated = {old for klass in getattr(cls, "__mro__", ())
                  for old in vars(klass).get("renamed_arguments", {})}
    return sorted({action.dest.split(".")[0] for action in parser._actions
                   if action.dest != "help"} - deprecated)


def _unknown_class_argument(message: str) -> str | None:
    match = _NOT_ACCEPTED.search(message)
    if match is None:
        return None
    class_path, name = match.groups()
    keys = _PARSER_KEY.findall(message[: match.start()])
    where = f"--{'.'.join(keys)} ({class_path.rsplit('.', 1)[-1]}): " if keys else ""
    return suggestion_message(where, "argument", name, class_arguments(class_path),
                              class_path.rsplit(".", 1)[-1])


def _unknown_option(message: str, parser: Any) -> str | None:
    """An unknown ``--group.name`` (or config key): the options of the deepest known group."""
    match = _UNKNOWN_OPTION.search(message)
    if match is None or parser is None:
        return None
    dests = [action.dest for action in parser._actions if action.dest != "help"]
    parts = match.group(1).split(".")
    depth = max(i for i in range(len(parts))
                if i == 0 or any(d.startswith(".".join(parts[:i]) + ".") for d in dests))
    group = ".".join(parts[:depth])
    names = sorted({d.split(".")[depth] for d in dests
                    if not group or d.startswith(group + ".")})
    owner = f"--{group}" if group else getattr(parser, "subcommand", None) or "the command"
    return suggestion_message(f"--{group}: " if group else "", "argument", parts[depth], names,
                              owner)


# ------------------------------------------------------------------------ parser messages
_BOILERPLATE = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:",
                "Given value type:", "Expected a <class 'NoneType'>", "Expected a path but",
                "Problem with given class_path", "Parser key")


def clean_parser_message(message: str, parser: Any = None) -> str:
    """A jsonargparse message without the Union and ``Given value: Namespace(...)`` noise; an
    unknown class or argument (of ``parser``, the one that refused it) with the closest names."""
    unknown = _unknown_class(message)
    if unknown is not None:
        return unknown
    automatic = _AUTOMATIC_OPTION.search(message)
    if automatic is not None:
        return automatic_option_message(automatic.group(1))
    unknown = _unknown_class_argument(message) or _unknown_option(message, parser)
    if unknown is not None:
        return unknown
    lines: list[str] = []
    for line in message.splitlines():
        text = _PARSER_KEY_PREFIX.sub("", line.strip().removeprefix("- "))
        if not text or text.startswith(_BOILERPLATE) or text in lines:
            continue
        if text.startswith("Given value:") and ("Namespace(" in text or "NestedArg(" in text
                                                or len(text) > 120):
            continue
        lines.append(text.replace("Given value:", "Got value:", 1))
    keys = _PARSER_KEY.findall(message)
    text = " ".join(lines) or "the value was refused (JSONARGPARSE_DEBUG=true shows why)"
    return f"--{'.'.join(keys)}: {text}" if keys else text


class ReadableArgumentParser(LightningArgumentParser):
    """Prints ``error: <short message>`` and a pointer to ``--help`` instead of the full usage
    and jsonargparse's nested Union report. Options are not abbreviated (``--trainer.max_epoch``
    is an unknown argument, not ``--trainer.max_epochs``), as jsonargparse 5 will have it; help
    entries are the short ones of :class:`~ssl_lightning.cli.help.ModuleHelpFormatter`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", ModuleHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        if not self.exit_on_error or debug_mode():
            super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        prog = parser.prog.replace(" [options]", "")
        sys.stderr.write(f"error: {clean_parser_message(message, parser)}\n"
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


def _one_line(name: str, value_error: bool, message: str) -> str:
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if value_error else f"{name}: {text}"


def one_line(err: BaseException) -> str:
    """``err``'s message on one line, after ``<Type>: `` unless it is a ValueError."""
    return _one_line(type(err).__name__, isinstance(err, ValueError), str(err))


# ------------------------------------------------------------------ errors of a subcommand
_PACKAGE = Path(__file__).resolve().parents[1]
_TRAINING_LOOP = Path(training_epoch_loop.__file__).resolve()
#: Raised by ssl_lightning's own checks while a run sets up: shown as their message.
_SETUP_ERRORS = (ValueError, TypeError, OSError)
#: In a traceback's text: a frame's file, and the exception line (``Type: message``).
_TRACEBACK_FILE = re.compile(r'^  File "([^"]+)", line \d+', re.MULTILINE)
_TRACEBACK_RAISED = re.compile(r"^([A-Za-z_][\w.]*): (.*)", re.MULTILINE | re.DOTALL)


def _worker_message(err: BaseException) -> str:
    """The original message of an exception a DataLoader worker re-raised (torch prefixes it
    with the worker's traceback), else ``err``'s own."""
    message, name = str(err), f"{type(err).__name__}: "
    if "\nOriginal Traceback" in message and name in message:
        return message.rpartition(name)[2]
    return message


def _origin(err: BaseException) -> tuple[str, type | None, str, list[Path]]:
    """Qualified type name, type (None when not a builtin one), message and traceback files of
    the exception that failed the run: ``err``, or the exception of a process started by
    ``ddp_spawn``, which torch re-raises as the text of its traceback."""
    if isinstance(err, ProcessRaisedException):
        _, found, trace = str(err).rpartition("Traceback (most recent call last):\n")
        raised = _TRACEBACK_RAISED.search(trace)
        if found and raised:
            name, message = raised.groups()
            kind = getattr(builtins, name, None)
            files = _TRACEBACK_FILE.findall(trace[: raised.start()])
            return (name, kind if isinstance(kind, type) else None, message,
                    [Path(file).resolve() for file in files])
    files = [frame.filename for frame in traceback.extract_tb(err.__traceback__)]
    return (f"{type(err).__module__}.{type(err).__qualname__}", type(err), _worker_message(err),
            [Path(file).resolve() for file in files])


def run_error_message(err: BaseException) -> str | None:
    """The one-line message for an exception raised while a subcommand runs, or None to keep
    its traceback.

    One line: an exception of ssl_lightning's own types (``TrainingDivergedError``,
    ``CorruptImageError``, ...) at any time, and a ``ValueError`` / ``TypeError`` / ``OSError``
    raised by ssl_lightning code before the training loop starts (the checks of ``setup``,
    ``configure_model``, ``on_fit_start`` / ``on_train_start``, the data module's
    ``prepare_data`` / ``setup``, the sanity check), also in a process of ``ddp_spawn``.
    Anything else is a bug, or an error of another library, and keeps its traceback.
    """
    name, kind, message, files = _origin(err)
    short = name.rpartition(".")[2]
    if name.startswith(f"{_PACKAGE.name}."):
        return _one_line(short, False, message)
    if (kind is not None and issubclass(kind, _SETUP_ERRORS) and files
            and files[-1].is_relative_to(_PACKAGE) and _TRAINING_LOOP not in files):
        return _one_line(short, issubclass(kind, ValueError), message)
    return None
