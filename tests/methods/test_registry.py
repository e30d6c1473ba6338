"""The method registry is complete: what a method brings (CONTRIBUTING.md, "Adding a method") is
there for every registered method, and everything that lists methods agrees with the registry.

Each test names what is missing: a registered method without its config, its docs section or
its own test file; an exported method class that is not registered; a README method row or
``methods.__all__`` that differs from the registry.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import ssl_lightning
import ssl_lightning.methods
from ssl_lightning.methods import SSLMethod
from ssl_lightning.methods.registry import (
    PROPERTIES,
    MethodEntry,
    Paper,
    method_entries,
    method_entry,
    register_method,
    small_vit,
)

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = method_entries()
BASES = {"SSLMethod", "MomentumMethod"}


def _config_class(path: Path) -> str:
    model = (yaml.safe_load(path.read_text()) or {}).get("model") or {}
    return str(model.get("class_path", "")).rpartition(".")[2]


def test_every_registered_method_ships_its_configs() -> None:
    missing = []
    for e in ENTRIES:
        for name in e.configs:
            path = ROOT / "configs" / name
            if not path.is_file():
                missing.append(f"{e.name}: configs/{name} is absent")
            elif _config_class(path) != e.cls.__name__:
                missing.append(f"{e.name}: configs/{name} trains {_config_class(path)}")
    assert not missing, f"configs missing or training another class: {missing}"
    assert all(e.configs for e in ENTRIES), [e.name for e in ENTRIES if not e.configs]
    registered = {e.cls.__name__: e for e in ENTRIES}
    unlisted = [f"configs/{path.name} ({cls})" for path in sorted((ROOT / "configs").glob("*.yaml"))
                if (cls := _config_class(path)) in registered
                and path.name not in registered[cls].configs]
    assert not unlisted, f"shipped configs not named by their method's registry entry: {unlisted}"


def test_every_registered_method_has_a_docs_section() -> None:
    missing = []
    for e in ENTRIES:
        page = ROOT / e.docs
        headings = [line for line in page.read_text().splitlines()
                    if line.startswith("#")] if page.is_file() else []
        if not any(re.search(rf"(?<![\w+-]){re.escape(e.title)}(?![\w+-])", h) for h in headings):
            missing.append(f"{e.name}: no heading naming {e.title!r} in {e.docs}")
    assert not missing, missing


def test_every_registered_method_has_its_own_test_file() -> None:
    """``tests/methods/test_<name>.py``, registered as ``tests=``, naming the class."""
    missing = []
    for e in ENTRIES:
        own = f"tests/methods/test_{e.name}.py"
        if e.tests != own:
            missing.append(f"{e.name}: tests={e.tests or '(none given)'!s}, not {own}")
        elif not (ROOT / own).is_file():
            missing.append(f"{e.name}: {own} is absent")
        elif not re.search(rf"\b{e.cls.__name__}\b", (ROOT / own).read_text()):
            missing.append(f"{e.name}: {own} does not name {e.cls.__name__}")
    assert not missing, missing


def test_every_exported_method_class_is_registered() -> None:
    registered = {e.cls for e in ENTRIES}
    for module in (ssl_lightning, ssl_lightning.methods):
        exported = {name: getattr(module, name) for name in module.__all__
                    if isinstance(getattr(module, name), type)
                    and issubclass(getattr(module, name), SSLMethod)}
        unregistered = sorted(name for name, cls in exported.items()
                              if cls not in registered and name not in BASES)
        assert not unregistered, f"{module.__name__} exports unregistered methods: {unregistered}"
    expected = BASES | {e.cls.__name__ for e in ENTRIES}
    exported = set(ssl_lightning.methods.__all__)
    assert exported == expected, (f"methods.__all__ lacks {sorted(expected - exported)}, has "
                                  f"unregistered {sorted(exported - expected)}")


def test_each_method_is_registered_once_under_its_file_name() -> None:
    wrong = [f"{e.name} (in {e.cls.__module__})" for e in ENTRIES
             if e.cls.__module__ != f"ssl_lightning.methods.{e.name}"]
    assert not wrong, f"registry names that are not their file's name: {wrong}"
    assert len({e.cls for e in ENTRIES}) == len(ENTRIES)


def test_readme_method_row_names_every_registered_method() -> None:
    row = next(line for line in (ROOT / "README.md").read_text().splitlines()
               if line.startswith("| Methods |"))
    missing = [e.title for e in ENTRIES if e.title.lower() not in row.lower()]
    assert not missing, f"README.md's Methods row does not name {missing}"


def test_docs_index_links_every_method_page() -> None:
    index = (ROOT / "docs" / "methods.md").read_text()
    pages = {e.docs for e in ENTRIES} - {"docs/methods.md"}
    missing = sorted(page for page in pages if f"({Path(page).name})" not in index)
    assert not missing, f"docs/methods.md does not link {missing}"


def test_every_small_instance_builds_an_instance_of_its_class() -> None:
    for e in ENTRIES:
        assert type(e.small()) is e.cls, e.name
        vit = small_vit(mask_token=True, num_registers=1)
        assert e.small(backbone=vit).backbone is vit, e.name
        assert all(isinstance(size, int) and size > 0 for size in e.views), e.name


def test_registration_refuses_a_taken_name_and_an_opt_out_without_reason() -> None:
    def entry_args(**changes: object) -> dict:
        args = dict(title="X", configs=(), paper=Paper("X", 2020), family="contrastive",
                    views=(8, 8), small=lambda backbone, **kw: None, tests="")
        return {**args, **changes}

    with pytest.raises(ValueError, match="'simclr' is registered by SimCLR"):
        register_method("simclr", **entry_args())(type("Other", (), {}))
    with pytest.raises(ValueError, match="must name one of .* and give a reason"):
        register_method("x", **entry_args(opt_outs={"micro_batching": " "}))
    with pytest.raises(ValueError, match="must name one of"):
        register_method("x", **entry_args(opt_outs={"no_such_property": "why"}))
    with pytest.raises(ValueError, match="CLI arguments for 'other.yaml', which is not one"):
        register_method("x", **entry_args(configs=("x.yaml",),
                                          cli_args={"other.yaml": ("--model.x", "1")}))
    assert method_entry("simclr").cls is ssl_lightning.methods.SimCLR
    with pytest.raises(KeyError, match="no method registered as 'nope'"):
        method_entry("nope")
    assert set(PROPERTIES) >= {p for e in ENTRIES for p in e.opt_outs}


def test_opt_outs_carry_reasons() -> None:
    for e in ENTRIES:
        for prop, reason in e.opt_outs.items():
            assert isinstance(e, MethodEntry) and len(reason.split()) >= 5, (e.name, prop)


def test_every_registered_method_builds_in_the_resume_harness() -> None:
    """``tests/resume_harness.py`` takes every registered method (its small instance on views of
    its registry crop sizes) unless a tuned instance of the same name replaces it."""
    import resume_harness

    for e in ENTRIES:
        model = resume_harness.METHODS[e.name]()
        assert type(model) is e.cls, e.name
        views = resume_harness.transform(e.name, model)
        if e.name not in resume_harness.TUNED:
            assert views.num_views == len(e.views), e.name
