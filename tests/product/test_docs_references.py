"""The manual cannot drift from the code: every file path, ``ssl_lightning.*`` name, class name,
``--model.* / --data.* / --trainer.*`` option and YAML ``class_path`` / ``init_args`` key that the
README, CONTRIBUTING.md or a page of ``docs/`` names exists in the tree."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import pytorch_lightning as pl
import yaml

import ssl_lightning
from ssl_lightning.data.base import SSLDataModule
from ssl_lightning.evaluation import KNNEval, LinearEval
from ssl_lightning.methods.base import SSLMethod

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])

#: Folders whose files a run creates (outputs named in examples), not files of the tree.
OUTPUT_DIRS = ("runs/", "data/", "lightning_logs/", "mlruns/", "wandb/", "out/", "/tmp/")
#: Names from the papers' official code and the peer libraries that the docs compare with
#: (``main_dino.py`` is DINO's training script, ``SimCLRTransform`` lightly's views, ...), and
#: ``/proc/self/status`` fields; they are not ours, so they are not looked up in the tree.
FOREIGN_NAMES = frozenset({
    "main_dino.py", "main_swav.py", "main_ibot.py", "main_deepclusterv2.py", "train.py",
    "main_vicregl.py", "configs/selfsup/densecl/densecl_r50_200ep.py",
    "ssl_default_config.yaml",
    "vitg14.yaml", "in1k_vith14_ep300.yaml", "configs/in1k_vith14_ep300.yaml",
    "SimCLRTransform", "DataAugmentationDINO", "MultiCropWrapper", "CosineWDSchedule",
    "VmHWM", "VmRSS", "KMeans",
})
#: Files a run writes beside its logs, or that a user writes (examples), not files of the tree.
OUTPUT_FILES = frozenset({"config.yaml", "my.yaml", "my_methods.py", "stats.yaml",
                          "test_my_methods.py", "train_my_data.py"})
#: Modules searched for a class name the docs mention that is not ssl_lightning's.
EXTERNAL_MODULES = (
    "torch", "torch.nn", "torch.optim", "torch.optim.lr_scheduler", "torch.utils.data",
    "torch.distributed", "torch.multiprocessing", "pytorch_lightning",
    "pytorch_lightning.callbacks", "pytorch_lightning.loggers", "pytorch_lightning.strategies",
    "pytorch_lightning.cli", "pytorch_lightning.plugins", "lightning_fabric.plugins",
    "torchvision.models", "torchvision.datasets", "torchvision.transforms",
    "torchvision.transforms.v2", "torchdata.stateful_dataloader", "litdata", "torchmetrics",
    "torchmetrics.classification", "jsonargparse", "PIL.Image", "numpy", "timm.models",
    "onnxruntime", "builtins",
)
PATH_PATTERN = re.compile(
    r"(?<![\w./-])((?:ssl_lightning|configs|docs|tests|benchmarks|\.ci|\.github)/[\w./-]*\w"
    r"|[\w-]+\.(?:py|yaml|md))(?![\w/-])"
)
DOTTED_PATTERN = re.compile(r"\bssl_lightning(?:\.\w+)+")
OPTION_PATTERN = re.compile(r"--(model|data|trainer)\.(?:init_args\.)?(\w+)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
#: A CamelCase word: capital first, a lower-case letter and another capital later (``SimCLR``,
#: ``NTXentLoss``); ALL_CAPS constants and plain words are not class names.
CLASS_NAME = re.compile(r"^[A-Z](?=[A-Za-z0-9]*[a-z])(?=[A-Za-z0-9]*[A-Z][A-Za-z0-9]*$)"
                        r"[A-Za-z0-9]+$")
PLACEHOLDER = re.compile(r"(?:^|/)[A-Z]+\.|<|\*|\{|\.\.\.")
YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.DOTALL)


def doc_ids() -> list[str]:
    return [str(path.relative_to(ROOT)) for path in DOCS]


@cache
def tree_files() -> frozenset[str]:
    skip_anywhere = {".git", ".venv", "venv", "__pycache__"}
    skip_top = {"runs", "data", "lightning_logs"}
    relative = (path.relative_to(ROOT) for path in ROOT.rglob("*") if path.is_file())
    return frozenset(str(path) for path in relative if path.parts[0] not in skip_top
                     and not skip_anywhere.intersection(path.parts))


@cache
def package_names() -> frozenset[str]:
    """Every module, class, function and attribute name defined at module level in the package."""
    names: set[str] = set()
    for info in pkgutil.walk_packages(ssl_lightning.__path__, "ssl_lightning."):
        module = importlib.import_module(info.name)
        names.add(info.name.rsplit(".", 1)[-1])
        for name, value in vars(module).items():
            names.add(name)
            if inspect.isclass(value) and value.__module__.startswith("ssl_lightning"):
                names.update(vars(value))
    return frozenset(names)


@cache
def test_names() -> frozenset[str]:
    """Classes and functions of the test suite's helpers (the docs describe the product matrix)."""
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
                names.add(node.name)
    return frozenset(names)


def resolves(dotted: str) -> bool:
    """``ssl_lightning.a.b.C.attr``: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(value, attribute):
                return False
            value = getattr(value, attribute)
        return True
    return False


def external_class(name: str) -> bool:
    for module_name in EXTERNAL_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, name):
            return True
    return False


def resolve_class(class_path: str) -> type | None:
    if "." not in class_path:
        return getattr(ssl_lightning, class_path, None)
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None


def all_subclasses(cls: type) -> Iterator[type]:
    for sub in cls.__subclasses__():
        yield sub
        yield from all_subclasses(sub)


def parameters(cls: type) -> set[str]:
    """Constructor parameters of ``cls`` and its bases (LightningCLI exposes the union)."""
    names: set[str] = set()
    for klass in inspect.getmro(cls):
        if "__init__" in vars(klass):
            names.update(inspect.signature(klass.__init__).parameters)
    return names - {"self", "args", "kwargs"}


@cache
def option_parameters() -> dict[str, frozenset[str]]:
    importlib.import_module("ssl_lightning.methods")
    from ssl_lightning.data.dense_pairs import DenseDataModule
    from ssl_lightning.evaluation.dense import DenseKNNSegmentation
    from ssl_lightning.evaluation.dense.linear_probe import DenseLinearProbe

    models = [SSLMethod, LinearEval, KNNEval, *all_subclasses(SSLMethod), DenseKNNSegmentation,
              DenseLinearProbe, *all_subclasses(DenseLinearProbe)]
    datas = [SSLDataModule, *all_subclasses(SSLDataModule), DenseDataModule,
             *all_subclasses(DenseDataModule)]
    return {
        "model": frozenset().union(*(parameters(cls) for cls in models)),
        "data": frozenset().union(*(parameters(cls) for cls in datas)),
        "trainer": frozenset(inspect.signature(pl.Trainer.__init__).parameters),
    }


def text_of(doc: Path) -> str:
    return doc.read_text(encoding="utf-8")


def path_exists(reference: str, doc: Path) -> bool:
    reference = reference.rstrip(".").removeprefix("./")
    if reference in FOREIGN_NAMES or reference in OUTPUT_FILES or PLACEHOLDER.search(reference):
        return True
    if reference.startswith(OUTPUT_DIRS) or "/version_" in reference:
        return True
    if (ROOT / reference).exists():  # also through the configs -> ssl_lightning/configs link
        return True
    files = tree_files()
    if "/" not in reference:  # a bare file name, e.g. ``base.py`` in a package listing
        return any(Path(path).name == reference for path in files)
    candidates = {reference, str((doc.parent / reference).resolve().relative_to(ROOT))
                  if (doc.parent / reference).resolve().is_relative_to(ROOT) else reference}
    return any(c in files or any(path.startswith(c.rstrip("/") + "/") for path in files)
               for c in candidates)


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_every_named_file_exists(doc: Path) -> None:
    missing = sorted({ref for ref in PATH_PATTERN.findall(text_of(doc))
                      if not path_exists(ref, doc)})
    assert not missing, f"{doc.name} names files that are not in the tree: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_every_dotted_name_resolves(doc: Path) -> None:
    missing = sorted({name for name in DOTTED_PATTERN.findall(text_of(doc))
                      if not resolves(name)})
    assert not missing, f"{doc.name} names ssl_lightning objects that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_every_class_name_exists(doc: Path) -> None:
    spans = (span.split("(")[0].split(".")[-1] for span in CODE_SPAN.findall(text_of(doc)))
    candidates = {span for span in spans if CLASS_NAME.match(span)}
    defined_here = set(re.findall(r"^class (\w+)", text_of(doc), re.M))  # the page's examples
    missing = sorted(name for name in candidates - defined_here
                     if name not in FOREIGN_NAMES and not name.startswith("My")  # a user's class
                     and name not in package_names() and name not in test_names()
                     and not external_class(name))
    assert not missing, f"{doc.name} names classes that exist nowhere: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_every_option_is_a_constructor_argument(doc: Path) -> None:
    known = option_parameters()
    missing = sorted({f"--{group}.{name}" for group, name in OPTION_PATTERN.findall(text_of(doc))
                      if name not in known[group] and name != "help"})
    assert not missing, f"{doc.name} names options that no class takes: {missing}"


def class_paths(node: object) -> Iterator[tuple[str, dict]]:
    if isinstance(node, dict):
        if isinstance(node.get("class_path"), str):
            yield node["class_path"], node.get("init_args") or {}
        for value in node.values():
            yield from class_paths(value)
    elif isinstance(node, list):
        for value in node:
            yield from class_paths(value)


@pytest.mark.parametrize("doc", DOCS, ids=doc_ids())
def test_yaml_blocks_name_real_classes_and_arguments(doc: Path) -> None:
    problems = []
    for block in YAML_BLOCK.findall(text_of(doc)):
        try:
            tree = yaml.safe_load(block)
        except yaml.YAMLError as err:
            problems.append(f"a YAML block does not parse: {err}")
            continue
        for class_path, init_args in class_paths(tree):
            cls = resolve_class(class_path)
            if cls is None:
                problems.append(f"class_path {class_path} does not exist")
                continue
            if inspect.isclass(cls):  # the union over its bases: what LightningCLI accepts
                accepted = parameters(cls)
            else:
                signature = inspect.signature(cls).parameters
                if any(p.kind is p.VAR_KEYWORD for p in signature.values()):
                    continue
                accepted = set(signature)
            problems += [f"{class_path} takes no argument {name!r}"
                         for name in init_args if name not in accepted and name != "..."]
    assert not problems, f"{doc.name}: {problems}"
