"""The help formatter of the command line: ``--model.help DINOv2`` lists every argument (the
inherited ones too) with the first sentence of its docstring and its default (or its type, for
a required argument).

An argument typed ``nn.Module`` (the backbone, an injected head) is described as "any
torch.nn.Module" instead of jsonargparse's list of the hundreds of ``torch.nn.Module``
subclasses it finds (``--model.backbone.help ViT`` shows one class's arguments), and the usage
line is ``PROG [options]``: the options follow, one entry each.
"""

from __future__ import annotations

import re
import textwrap
from argparse import SUPPRESS, Action
from collections.abc import Iterable
from typing import Any

from jsonargparse import DefaultHelpFormatter

#: jsonargparse's suffix for a class-typed argument whose base is ``torch.nn.Module``.
_MODULE_SUBCLASSES = re.compile(r", known subclasses: torch\.nn\.Module\b[^)]*")
MODULE_HINT = ", any torch.nn.Module: class_path and init_args"
#: reST roles and literals of the docstrings: ``:class:`~a.B``` -> ``B``, ````x```` -> ``x``.
_ROLE = re.compile(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`")
_LITERAL = re.compile(r"``([^`]*)``")


def first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence (a period outside parentheses followed by
    a capitalised word), without reST markup."""
    text = _LITERAL.sub(r"\1", _ROLE.sub(r"\1", " ".join(text.split())))
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if (char == "." and depth == 0 and text[i + 1:i + 2] == " "
                and text[i + 2:i + 3].isupper()):
            return text[:i + 1]
    return text


class ModuleHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, one short entry per argument (see the module docstring)."""

    def _get_help_string(self, action: Action) -> str:
        text = super()._get_help_string(action)
        if action.help and text.startswith(action.help):
            text = first_sentence(action.help) + text[len(action.help):]
        if "default: %(default)s" in text:  # the default shows the type
            text = text.replace("type: %(type)s, ", "")
        return _MODULE_SUBCLASSES.sub(MODULE_HINT, text)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Descriptions wrapped at spaces only, so a name such as ``channel-stats`` or
        ``64-true`` is never split across two lines."""
        text = " ".join(text.split())
        return textwrap.fill(text, width, initial_indent=indent, subsequent_indent=indent,
                             break_on_hyphens=False)

    def _format_action_invocation(self, action: Action) -> str:
        """The option strings without the value placeholder (kept for the ``.help`` actions,
        whose value is a class name)."""
        if action.option_strings and action.nargs != 0 and action.default != SUPPRESS:
            return ", ".join(action.option_strings)
        return super()._format_action_invocation(action)

    def add_usage(self, usage: str | None, actions: Iterable[Action],
                  groups: Iterable[Any], prefix: str | None = None) -> None:
        """``PROG [options]`` in the usage line (``prefix=""``: argparse building a subcommand's
        prog, left as it is)."""
        if usage is None and prefix != "":
            usage = "%(prog)s [options]"
        super().add_usage(usage, actions, groups, prefix)
