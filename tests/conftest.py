"""Shared fixtures: tiny synthetic image folders and a runner for the real CLI on a config.

- ``make_image_folder(root, classes, per_class, size)``: writes deterministic JPEGs as
  ``root/<class_i>/<j>.jpg`` (classes differ in colour, so a kNN on raw pixels separates them).
- ``tiny_image_folder``: session-wide ``root/{train,test}/<class>/*.jpg``, 2 classes × 12 train
  and × 6 test images of 32 px: the layout of the shared CIFAR-10 copy. Do not modify it.
- ``run_config(config_path, extra_args=(), subcommand="fit")``: runs ``ssl_lightning.cli.main``
  on a config with tiny data on CPU (``fast_dev_run``, batch 4, no workers) from a temporary
  working directory, and returns the ``LightningCLI`` object (``cli.trainer``, ``cli.model``).
"""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

# The costliest files first, so that the two xdist workers end together (file_order.py).
from file_order import pytest_collection_modifyitems
from PIL import Image

# The slow tier: marked on the tests; one started process fails an unmarked test (slow_tier.py).
from slow_tier import pytest_runtest_call, pytest_runtest_setup

__all__ = ["pytest_collection_modifyitems", "pytest_runtest_call", "pytest_runtest_setup"]

ImageFolderMaker = Callable[..., Path]

#: The rendezvous variables a process group in this process reads. Lightning's launchers write
#: them into ``os.environ`` (``MASTER_PORT`` stays set after a ddp_spawn fit or an in-process
#: sharded fit), so the next test's process group, or a subprocess inheriting the environment,
#: would bind the same port while an earlier store may still listen on it (EADDRINUSE).
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
_SESSION_RENDEZVOUS = {name: os.environ.get(name) for name in RENDEZVOUS}


@pytest.fixture(autouse=True)
def _fresh_rendezvous() -> Iterator[None]:
    """Every test starts with the session's rendezvous variables (normally none), so each
    process group it starts picks a free port of its own."""
    _restore_rendezvous()
    yield
    _restore_rendezvous()


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny-tensor tests (``pytestmark =
    pytest.mark.usefixtures("one_thread")``): faster there, and fair to a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> Any:
    """The expensive runs a test module shares (multi-process fits and their one-process
    references, resume harness runs), made once per module: what the module's ``make_runs``
    returns. Its parameters name the fixtures it needs (e.g. ``tmp_path_factory``,
    ``make_image_folder``), and what it returns is the module's own shape."""
    make_runs = getattr(request.module, "make_runs", None)
    if make_runs is None:
        raise pytest.UsageError(f"{request.module.__name__} uses the runs fixture but defines "
                                "no make_runs(...) returning its shared runs.")
    fixtures = inspect.signature(make_runs).parameters
    return make_runs(**{name: request.getfixturevalue(name) for name in fixtures})


def _restore_rendezvous() -> None:
    for name, value in _SESSION_RENDEZVOUS.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value

# The suite's image indexes (ssl_lightning/data/indexing.py) are cached in a temporary folder of
# its own (inherited by the CLI subprocesses), not in ~/.cache; under pytest-xdist, one per worker.
if os.environ.get("PYTEST_XDIST_WORKER") or "SSL_LIGHTNING_CACHE_DIR" not in os.environ:
    os.environ["SSL_LIGHTNING_CACHE_DIR"] = tempfile.mkdtemp(prefix="ssl_lightning_cache_")

# Under pytest-xdist (pyproject's addopts start 2 workers) the workers share the cores: each
# worker's torch, and each process it starts, gets cores // workers intra-op threads (two
# workers of two threads each on 2 cores would oversubscribe them).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    _THREADS = max(1, (_CORES or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_THREADS)
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))


def _write_images(root: Path, classes: int, per_class: int, size: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        base = np.zeros(3)
        base[c % 3] = 180.0 + 30.0 * (c // 3)
        for j in range(per_class):
            noise = rng.normal(0.0, 25.0, size=(size, size, 3))
            pixels = np.clip(base + 40.0 + noise, 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(folder / f"{j:03d}.jpg", quality=95)
    return root


@pytest.fixture(scope="session")
def make_image_folder() -> ImageFolderMaker:
    """Factory ``make(root, classes=2, per_class=12, size=32, seed=0) -> root``."""

    def make(root: Path, classes: int = 2, per_class: int = 12, size: int = 32,
             seed: int = 0) -> Path:
        return _write_images(Path(root), classes, per_class, size, seed)

    return make


@pytest.fixture(scope="session")
def tiny_image_folder(tmp_path_factory: pytest.TempPathFactory,
                      make_image_folder: ImageFolderMaker) -> Path:
    """``root/train/<class>/*.jpg`` (2 × 12) and ``root/test/<class>/*.jpg`` (2 × 6), 32 px."""
    root = tmp_path_factory.mktemp("tiny_image_folder")
    make_image_folder(root / "train", classes=2, per_class=12, seed=0)
    make_image_folder(root / "test", classes=2, per_class=6, seed=1)
    return root


def _resolve_class(class_path: str) -> type:
    import ssl_lightning

    if "." not in class_path:
        return getattr(ssl_lightning, class_path)
    module, _, name = class_path.rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)


def read_config(config_path: str | Path) -> dict:
    """A config file as the CLI reads it: ``trainer.callbacks`` given as a path (a shared piece,
    e.g. ``shared/pretrain_callbacks.yaml``) is loaded relative to the including file."""
    config_path = Path(config_path)
    config = yaml.safe_load(config_path.read_text())
    trainer = config.get("trainer") or {}
    if isinstance(trainer.get("callbacks"), str):
        trainer["callbacks"] = yaml.safe_load(
            (config_path.parent / trainer["callbacks"]).read_text())
    return config


def tiny_data_args(config_path: Path, data_root: Path) -> list[str]:
    """CLI overrides pointing the config's data module at ``data_root`` with tiny loaders."""
    from ssl_lightning.data import SSLDataModule

    config = yaml.safe_load(Path(config_path).read_text())
    data = config.get("data") or {}
    if "class_path" not in data:
        return []
    cls = _resolve_class(data["class_path"])
    params = inspect.signature(cls.__init__).parameters
    args: list[str] = []
    if "root" in params:
        args += ["--data.root", str(data_root)]
    if "train_dir" in params:
        args += ["--data.train_dir", str(data_root / "train"),
                 "--data.val_dir", str(data_root / "test")]
    if issubclass(cls, SSLDataModule):
        args += ["--data.batch_size", "4", "--data.num_workers", "0"]
    return args


#: Trainer overrides for every config run in tests: one CPU step of train and validation.
TINY_TRAINER_ARGS = [
    "--trainer.fast_dev_run", "true",
    "--trainer.accelerator", "cpu",
    "--trainer.devices", "1",
    "--trainer.precision", "32-true",
]


@pytest.fixture
def run_config(tmp_path: Path, tiny_image_folder: Path, monkeypatch: pytest.MonkeyPatch):
    """Run the real CLI on a config with tiny data; see the module docstring."""
    from ssl_lightning.cli import main

    def run(config_path: str | Path, extra_args: Sequence[str] = (), subcommand: str = "fit"):
        config_path = Path(config_path).resolve()
        monkeypatch.chdir(tmp_path)
        args = [subcommand, "--config", str(config_path),
                *tiny_data_args(config_path, tiny_image_folder), *TINY_TRAINER_ARGS,
                *extra_args]
        return main(args)

    return run
