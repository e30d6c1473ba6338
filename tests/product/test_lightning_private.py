"""Lightning's private API is read in one module, ``ssl_lightning/_lightning_private.py``.

The private names of Lightning are taken from its installed source (every ``_name`` it defines
as a function, class, module variable or attribute), so an upgrade that adds or drops one is
seen; the package's modules are scanned (ast) for attribute reads and writes of those names
and for overrides of Lightning's private methods. The failure names each use outside that
module: after a Lightning upgrade, the functions there (and ``OVERRIDDEN``) are what to check.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

import pytest
from torch import nn

from ssl_lightning._lightning import FABRIC_PACKAGE, PACKAGE
from ssl_lightning._lightning_private import OVERRIDDEN

ROOT = Path(__file__).resolve().parents[2]
ACCESSORS = ROOT / "ssl_lightning" / "_lightning_private.py"
#: The package's own private names that Lightning also uses for something of its own (each
#: checked by hand: here none is an attribute of a Lightning object).
OWN_NAMES = {"_batch_idx", "_device", "_download", "_is_dir", "_lock", "_lr", "_sampler", "_start"}
#: torch's ``nn.Module`` internals (``_modules``, ...) are torch's, not Lightning's.
TORCH_NAMES = set(dir(nn.Module)) | set(vars(nn.Module()))
#: Public attributes whose API is Lightning's internals all the same: the Trainer's loops.
LOOPS = {"fit_loop", "validate_loop", "test_loop", "predict_loop"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_names(tree: ast.AST) -> set[str]:
    """The private names a source file defines: functions, classes, variables, attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {name for name in names if _private(name)}


@cache
def lightning_private_names() -> frozenset[str]:
    """Every private name the installed Lightning (trainer and fabric packages) defines."""
    names: set[str] = set()
    for package in (PACKAGE, FABRIC_PACKAGE):
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, package
        for folder in spec.submodule_search_locations:
            for path in Path(folder).rglob("*.py"):
                names |= _defined_names(ast.parse(path.read_text(encoding="utf-8")))
    return frozenset(names - OWN_NAMES - TORCH_NAMES)


def _attribute_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, source)`` of each attribute read or written in ``tree`` that is private to
    Lightning or one of its loops (``super()._name(...)`` in an override is the override's)."""
    private = lightning_private_names() | LOOPS
    return [(node.lineno, ast.unparse(node)) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in private
            and not (isinstance(node.value, ast.Call)
                     and getattr(node.value.func, "id", "") == "super")]


def _uses(path: Path) -> list[tuple[int, str]]:
    """``(line, what)`` of each use of Lightning's private API in ``path``: an attribute
    (:func:`_attribute_uses`), or a method of a class that overrides a private one."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    overrides = [(item.lineno, f"def {node.name}.{item.name}") for node in ast.walk(tree)
                 if isinstance(node, ast.ClassDef) for item in node.body
                 if isinstance(item, ast.FunctionDef) and item.name in lightning_private_names()]
    return _attribute_uses(tree) + overrides


def test_lightning_private_names_are_found_in_its_source() -> None:
    names = lightning_private_names()
    assert {"_trainer", "_accelerator_connector", "_checkpoint_connector"} <= names


def test_lightning_private_api_is_used_only_in_one_module() -> None:
    outside = [f"{path.relative_to(ROOT)}:{line}: {what}"
               for path in sorted((ROOT / "ssl_lightning").rglob("*.py")) if path != ACCESSORS
               for line, what in _uses(path)
               if not (what.startswith("def ") and what.rpartition(".")[2] in
                       {name.rpartition(".")[2] for name in OVERRIDDEN})]
    assert not outside, (
        "Lightning's private API used outside ssl_lightning/_lightning_private.py (read it "
        f"there in a small commented function, or list an override in OVERRIDDEN): {outside}")


def test_every_private_read_is_in_a_documented_function() -> None:
    tree = ast.parse(ACCESSORS.read_text(encoding="utf-8"))
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    reads = {node.name: _attribute_uses(node) for node in functions}
    undocumented = [node.name for node in functions if not ast.get_docstring(node)]
    assert not undocumented, f"accessors without a docstring saying what they are for: " \
                             f"{undocumented}"
    idle = [name for name, found in reads.items() if not found]
    assert not idle, f"functions of _lightning_private.py that read nothing of Lightning's: {idle}"
    loose = set(_attribute_uses(tree)) - {use for found in reads.values() for use in found}
    assert not loose, f"private reads outside a function of _lightning_private.py: {loose}"


@pytest.mark.parametrize("override", sorted(OVERRIDDEN))
def test_every_listed_override_exists_in_lightning_and_in_the_package(override: str) -> None:
    owner, _, method = override.partition(".")
    assert method in lightning_private_names(), f"{override}: Lightning has no such method now"
    defined = [what for path in sorted((ROOT / "ssl_lightning").rglob("*.py"))
               for _, what in _uses(path) if what.startswith("def ") and what.endswith(method)]
    assert defined, f"{override} is listed in OVERRIDDEN but overridden nowhere"
