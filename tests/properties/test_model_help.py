"""Property of every registered class: ``--model.help <Class>`` stays short, names every
argument, and offers no argument the class refuses.

Short: one entry per argument (at most 3 lines at 80 columns), no list of the nn.Module
subclasses (the help before ``cli/help.py`` was 1,673 lines for SimCLR's ~30 arguments), every
constructor argument of the ``**kwargs`` chain present with its default. Offered, not refused:
for every offered argument with a number or boolean default, some other value (the boolean
flipped; an int one up or down; a float halved or doubled) builds the class's small instance on
its ConvNet or on a ViT, or the error names another argument it depends on (a combination, e.g.
iBOT++'s ``patch_visible_weight`` needs ``centering='center'``). ``DCL`` offering SimCLR's
``margin`` and raising "DCL has no margin" is what this catches. Opt-outs: ``model_help_short``,
``model_help_accepted``, each with its reason, printed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import warnings
from typing import Any

import pytest
from opt_outs import skip_opted_out

from ssl_lightning.cli import main
from ssl_lightning.methods import SSLMethod
from ssl_lightning.methods.registry import MethodEntry, method_entries, small_vit

ENTRIES = method_entries()


def help_entries(out: str) -> dict[str, str]:
    """``{option: its help on one line}`` of a ``--model.help`` output."""
    entries: dict[str, str] = {}
    option = ""
    for line in out.splitlines():
        if line.startswith("  --"):
            option, _, text = line.strip().partition(" ")
            if option.endswith(","):  # "--model.x, --model.x+": a list argument
                option = option[:-1]
                text = text.partition(" ")[2]
            entries[option] = text
        elif option and line.startswith("    "):
            entries[option] += " " + line.strip()
    return {option: " ".join(text.split()) for option, text in entries.items()}


def constructor_arguments(cls: type) -> dict[str, inspect.Parameter]:
    """Every argument ``cls`` accepts through the ``**kwargs`` chain down to SSLMethod, with
    the parameter of the first class that names it."""
    found: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if not (isinstance(klass, type) and issubclass(klass, SSLMethod)):
            continue
        for name, parameter in inspect.signature(klass.__init__).parameters.items():
            if name != "self" and parameter.kind not in (parameter.VAR_KEYWORD,
                                                         parameter.VAR_POSITIONAL):
                found.setdefault(name, parameter)
    return found


@functools.cache
def model_help(cls: type) -> str:
    """The output of ``fit --model.help <cls>`` at 80 columns (made once per class)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out):
        patch.setenv("COLUMNS", "80")
        with pytest.raises(SystemExit) as exit_info:
            main(["fit", "--model.help", cls.__name__])
    assert exit_info.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_model_help_is_short_and_names_every_argument(entry: MethodEntry) -> None:
    skip_opted_out(entry, "model_help_short")
    out = model_help(entry.cls)
    arguments = sum(line.startswith("  --model.") for line in out.splitlines())
    assert arguments > 10 and len(out.splitlines()) < 20 + 3 * arguments, out
    assert "torch.nn.Linear" not in out  # no list of every nn.Module subclass
    entries = help_entries(out)
    for name, parameter in constructor_arguments(entry.cls).items():
        entry_text = entries.get(f"--model.{name}")
        assert entry_text is not None, f"{entry.cls.__name__}: --model.{name} is not in the help"
        assert ("required" if name == "backbone" else "default:") in entry_text, entry_text
        if isinstance(parameter.default, float):
            assert f"default: {parameter.default})" in entry_text, entry_text
    assert "default: 0.9)" in entries["--model.momentum"]  # an inherited optimiser argument


def other_values(parameter: inspect.Parameter) -> list[Any]:
    """Non-default values to try for ``parameter`` (none for strings, sequences, modules)."""
    default, annotation = parameter.default, str(parameter.annotation).replace(" ", "")
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        return [default + 1, default - 1] if default > 0 else [default + 1]
    if isinstance(default, float):
        return [default / 2, default * 2] if default else [0.5]
    if default is None and annotation in ("int|None", "float|None"):
        return [2] if annotation.startswith("int") else [0.5]
    return []


def refusal(entry: MethodEntry, name: str, value: Any) -> str | None:
    """Why the small instance refuses ``name=value`` on its backbone and on a ViT, or None
    when one of them takes it (or the small factory sets ``name`` itself)."""
    errors = []
    for backbone in (None, small_vit()):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deprecated names warn
                entry.small(backbone, **{name: value})
            return None
        except TypeError as error:
            if "multiple values" in str(error):
                return None  # the small instance sets it: taken
            errors.append(f"{type(error).__name__}: {error}")
        except ValueError as error:
            errors.append(f"{type(error).__name__}: {error}")
    return errors[-1]


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_model_help_offers_no_argument_the_class_refuses(entry: MethodEntry) -> None:
    skip_opted_out(entry, "model_help_accepted")
    offered = {option.removeprefix("--model.") for option in help_entries(model_help(entry.cls))
               if option.startswith("--model.")}
    parameters = constructor_arguments(entry.cls)
    refused = {}
    for name in sorted(offered & set(parameters)):
        reasons = [refusal(entry, name, value) for value in other_values(parameters[name])]
        if reasons and all(reasons):
            others = offered - {name}
            if not any(f"{other}{sep}" in reason for sep in ("=", " ", ":")
                       for reason in reasons for other in others):
                refused[name] = reasons[0]
    assert not refused, f"--model.help {entry.cls.__name__} offers arguments it refuses: {refused}"
