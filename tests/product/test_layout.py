"""The package layout: no import circle, `evaluation/` independent of `methods/`, `methods/`
holding only methods, the re-exports at older import paths, and docs/layout.md matching the
tree."""

from __future__ import annotations

import ast
import graphlib
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "ssl_lightning"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported (also under ``if
    TYPE_CHECKING:`` and ``try:``), not those inside functions or classes."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                todo += getattr(node, field, [])
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return found


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The package modules an import statement of ``module`` names."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    base = node.module or ""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    targets = set()
    for alias in node.names:
        if f"{base}.{alias.name}" in MODULES:
            targets.add(f"{base}.{alias.name}")  # a submodule
        elif base in MODULES:
            targets.add(base)
    return targets


def _imports(module: str, everywhere: bool = False) -> set[str]:
    tree = ast.parse(MODULES[module].read_text())
    nodes = ([n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
             if everywhere else _module_level_imports(tree))
    return set().union(*(_targets(module, n) for n in nodes)) - {module}


def _body(path: Path) -> list[ast.stmt]:
    """The statements of ``path`` after its docstring."""
    body = ast.parse(path.read_text()).body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return body


def _is_reexport(path: Path) -> bool:
    """A module made of a docstring and one ``from ssl_lightning... import ...`` of another
    folder, or a moved module (:func:`_moved_to`)."""
    body = _body(path)
    return (len(body) == 1 and isinstance(body[0], ast.ImportFrom)
            and (body[0].module or "").startswith("ssl_lightning.")
            and not (body[0].module or "").startswith(_module_name(path).rpartition(".")[0])
            ) or _moved_to(path) is not None


def _moved_to(path: Path) -> str | None:
    """The new path of a moved module: one that is ``from NEW import *`` and
    ``warn_moved(__name__, "NEW")`` (ssl_lightning/compat/moved.py), else None."""
    stars = [node.module for node in _body(path) if isinstance(node, ast.ImportFrom)
             and [alias.name for alias in node.names] == ["*"]]
    calls = [node.value for node in _body(path) if isinstance(node, ast.Expr)
             and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") ==
             "warn_moved"]
    if len(stars) == 1 and len(calls) == 1 and len(_body(path)) == 3:
        new = calls[0].args[1]
        return stars[0] if isinstance(new, ast.Constant) and new.value == stars[0] else None
    return None


#: ``old module -> new module`` of the moved modules (they re-export and warn).
MOVED = {module: new for module, path in MODULES.items() if (new := _moved_to(path))}


def _graph() -> dict[str, set[str]]:
    """Every module -> the package modules it imports, at import time or inside a function
    (a deferred import hides a circle from Python, not from the reader). An import of a package
    that holds the module (``import ssl_lightning``, ``import ssl_lightning.methods`` in
    ``methods/registry.py``) is no edge: a package is imported before any of its modules."""
    def ancestors(module: str) -> set[str]:
        parts = module.split(".")
        return {".".join(parts[:i]) for i in range(1, len(parts))}

    return {module: _imports(module, everywhere=True) - ancestors(module) for module in MODULES}


def test_no_import_circle_among_the_package_modules() -> None:
    try:
        tuple(graphlib.TopologicalSorter(_graph()).static_order())
    except graphlib.CycleError as error:
        pytest.fail(f"import circle: {' -> '.join(error.args[1])}")


#: The folders of the package from the bottom up: a module imports only from its own layer or
#: the layers below. ``ssl_lightning/__init__.py`` (the public names) and ``__main__.py`` are
#: above them all.
LAYERS: list[set[str]] = [
    {"_lightning", "_lightning_private", "compat"},  # Lightning's namespace; old names
    {"io", "distributed"},  # files; processes (collectives, sharding)
    {"data"},
    {"training", "masking", "optim", "queues", "clustering"},
    {"backbones", "losses", "heads"},
    {"callbacks"},
    {"methods"},
    {"evaluation"},
    {"cli", "testing"},
]


def _layer(module: str) -> int:
    """The layer of ``module``'s folder (a module directly under ``ssl_lightning/`` is its own
    folder); the package itself and ``__main__`` are above every layer."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return len(LAYERS)
    folder = parts[1]
    found = [i for i, layer in enumerate(LAYERS) if folder in layer]
    assert found, f"{module}: the folder {folder!r} has no layer in LAYERS; add it there"
    return found[0]


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = [f"{module} -> {target}" for module, targets in sorted(_graph().items())
              if module not in MOVED and not _is_reexport(MODULES[module])
              for target in sorted(targets)
              if target not in MOVED and _layer(target) > _layer(module)]
    assert not upward, ("imports from a higher layer (see LAYERS; move the shared code down "
                        f"or the importer up): {upward}")


def test_the_package_imports_no_moved_module() -> None:
    old = [f"{module} -> {target}" for module, targets in sorted(_graph().items())
           for target in sorted(targets) if target in MOVED and module not in MOVED]
    assert not old, f"imports of an old path (import from the new one, see MOVED): {old}"


def test_evaluation_imports_nothing_from_methods() -> None:
    offenders = {module: sorted(t for t in _imports(module, everywhere=True)
                                if t.startswith("ssl_lightning.methods"))
                 for module in MODULES if module.startswith("ssl_lightning.evaluation")}
    assert not {m: t for m, t in offenders.items() if t}


def test_methods_holds_only_base_momentum_registry_and_one_file_per_method() -> None:
    from ssl_lightning import methods
    from ssl_lightning.methods.registry import method_entries

    registered = {entry.cls for entry in method_entries()}
    for path in sorted((PACKAGE / "methods").glob("*.py")):
        if path.name in ("__init__.py", "base.py", "momentum.py", "registry.py") or \
                _is_reexport(path):
            continue
        module = importlib.import_module(_module_name(path))
        defined = [value for value in vars(module).values()
                   if isinstance(value, type) and value.__module__ == module.__name__]
        assert defined and all(cls in registered and issubclass(cls, methods.SSLMethod)
                               for cls in defined), (
            f"{path.name} defines {[c.__name__ for c in defined]}, not a registered method "
            "(@register_method): machinery belongs in training/, masking/, backbones/ ...")


def test_method_files_do_not_import_the_ema_callback() -> None:
    for module in MODULES:
        if module.startswith("ssl_lightning.methods.") and not module.endswith(".momentum"):
            assert not {t for t in _imports(module, everywhere=True)
                        if t.startswith("ssl_lightning.callbacks")}, module


OLD_PATHS = [
    ("ssl_lightning.methods.grad_cache", "ssl_lightning.training.grad_cache",
     ["grad_cached_loss", "check_micro_batch_size"]),
    ("ssl_lightning.methods.step_rng", "ssl_lightning.training.step_rng",
     ["SeededSteps", "step_seed", "default_seed", "reseed_global_rng", "RNG_SEED_KEY"]),
    ("ssl_lightning.methods.divergence", "ssl_lightning.training.divergence",
     ["TrainingDivergedError", "check_finite_loss", "check_finite_weights"]),
    ("ssl_lightning.methods.masking", "ssl_lightning.masking",
     ["random_masking", "MultiBlockMasking", "Range"]),
    ("ssl_lightning.methods.masked_modeling", "ssl_lightning.backbones.tokens",
     ["TokenBackbone", "as_token_backbone", "token_grid", "check_views", "layout"]),
    ("ssl_lightning.methods.multicrop_forward", "ssl_lightning.backbones.multicrop",
     ["forward_by_resolution"]),
    ("ssl_lightning.data.block_masking", "ssl_lightning.masking.block",
     ["BlockMaskGenerator", "BlockMasking"]),
    ("ssl_lightning.callbacks.ema", "ssl_lightning.training.ema",
     ["momentum_teacher", "ema_update_", "Schedule", "BufferPolicy"]),
    ("ssl_lightning.callbacks.ema", "ssl_lightning.optim.schedules", [("cosine_momentum",
                                                                       "cosine_ramp")]),
]


@pytest.mark.parametrize(("old", "new"), sorted(MOVED.items()))
def test_a_moved_module_warns_and_gives_the_same_objects(old: str, new: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, old, raising=False)  # imported afresh: it warns once
    with pytest.warns(FutureWarning, match=rf"{re.escape(old)} has moved to {re.escape(new)};"):
        old_module = importlib.import_module(old)
    new_module = importlib.import_module(new)
    public = [name for name in vars(new_module) if not name.startswith("_")]
    assert public and all(getattr(old_module, name) is getattr(new_module, name)
                          for name in public)


def test_an_older_config_naming_the_old_sharding_path_still_parses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from ssl_lightning.cli import main

    new = (PACKAGE / "configs" / "shared" / "fsdp.yaml").read_text()
    assert "class_path: ssl_lightning.distributed.sharding.ShardedStrategy" in new
    old = tmp_path / "old_fsdp.yaml"
    old.write_text(new.replace("ssl_lightning.distributed.sharding.", "ssl_lightning.sharding."))
    monkeypatch.delitem(sys.modules, "ssl_lightning.sharding", raising=False)
    with pytest.warns(FutureWarning, match="ssl_lightning.sharding has moved"), \
            pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", "simclr", "--config", str(old), "--print_config"])
    assert exit_info.value.code == 0
    assert "class_path: ssl_lightning.sharding.ShardedStrategy" in capsys.readouterr().out


def test_the_moved_modules_include_every_former_top_level_module() -> None:
    assert {"ssl_lightning.sharding", "ssl_lightning.queue", "ssl_lightning.deprecation",
            "ssl_lightning.commands", "ssl_lightning.pretraining",
            "ssl_lightning.training.support_set"} <= set(MOVED)


@pytest.mark.parametrize(("old", "new", "names"), OLD_PATHS)
def test_old_import_paths_give_the_same_objects(old: str, new: str, names: list) -> None:
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        old_name, new_name = name if isinstance(name, tuple) else (name, name)
        assert getattr(old_module, old_name) is getattr(new_module, new_name), old_name


def test_deprecated_mask_names_warn_and_draw_the_same_masks() -> None:
    from ssl_lightning.masking import BlockMaskGenerator, BlockMasking, RandomMasking
    from ssl_lightning.masking import random_masking as deprecated_random_masking

    torch.manual_seed(0)
    new = RandomMasking(64, 0.75)(4, world_size=2, rank=1)
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match="RandomMasking"):
        old = deprecated_random_masking(4, 64, 0.75, world_size=2, rank=1)
    assert all(torch.equal(a, b) for a, b in zip(new, old, strict=True))
    with pytest.warns(DeprecationWarning, match="BlockMasking"):
        generator = BlockMaskGenerator(ratio=(0.5, 0.5), probability=1.0)
    torch.manual_seed(1)
    masks = generator(3, (8, 8))
    torch.manual_seed(1)
    assert isinstance(generator, BlockMasking)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(BlockMasking(ratio=(0.5, 0.5), probability=1.0)(3, (8, 8)), masks)


def _layout_entries() -> dict[str, str]:
    """``{name: text}`` of the entries directly under ``ssl_lightning/`` in docs/layout.md."""
    text = (ROOT / "docs" / "layout.md").read_text()
    block = text.split("```")[1].split("\nssl_lightning/\n", 1)[1]
    entries: dict[str, str] = {}
    name = ""
    for line in block.splitlines():
        if re.match(r"^  \S", line):
            name, _, rest = line.strip().partition(" ")
            entries[name] = rest
        elif re.match(r"^   +\S", line) and name:
            entries[name] += " " + line.strip()
        else:
            break  # the first line back at the top level (configs/, docs/, ...)
    return entries


def _registered_method_files() -> set[str]:
    from ssl_lightning.methods.registry import method_entries

    return {Path(str(importlib.import_module(entry.cls.__module__).__file__)).name
            for entry in method_entries()}


def test_layout_doc_lists_every_module_of_the_tree() -> None:
    entries = _layout_entries()
    top = {p.name + ("/" if p.is_dir() else "") for p in PACKAGE.iterdir()
           if (p.suffix == ".py" and not _is_reexport(p)) or (p / "__init__.py").is_file()}
    assert set(entries) == top
    for name, text in entries.items():
        if not name.endswith("/"):
            continue
        listed = set(re.findall(r"\b\w+\.py\b", text))
        files = {p.name for p in (PACKAGE / name).glob("*.py")
                 if p.name != "__init__.py" and not _is_reexport(p)}
        if name == "methods/":  # one file per registered method: the registry lists them
            files -= _registered_method_files()
        assert listed == files, f"docs/layout.md {name}: missing {sorted(files - listed)}, " \
                                f"not in the tree {sorted(listed - files)}"
