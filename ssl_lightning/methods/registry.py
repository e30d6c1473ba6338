"""The method registry: every method registers itself once, next to its class.

A method file decorates its class with :func:`register_method` (as timm's ``@register_model``
does for a model function): its registry name, the configs it ships, its paper, its family, the
views its small instance takes, a small-instance factory for tests and benchmarks, where its
docs and tests are, and the properties it opts out of, each with the reason. The package's
``__all__``, ``python -m ssl_lightning list methods``, the property tests (``tests/properties/``)
and the benchmarks read the methods from here, and ``tests/methods/test_registry.py`` fails,
naming what is missing, when a registered method lacks its config, docs section or test file.

The small instances are BatchNorm-free (GroupNorm ConvNets, ViTs without BatchNorm heads), so
they train in float64 and micro-batches equal the whole batch; they run on the views of
:attr:`MethodEntry.views` (crop sides in pixels, one entry per view).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from torch import nn

from ssl_lightning.backbones import SmallConvNet, ViT

Family = Literal["contrastive", "non-contrastive", "distillation", "clustering", "masked",
                 "predictive"]
#: The guarantees checked for every registered method (``tests/properties/``: micro-batching,
#: autocast, checkpoints, model_help, ddp_equals_one_process (in the sampler's order),
#: load_without_arguments (``load_from_checkpoint``), exact_resume (inside an epoch, bit-exact);
#: sharded = DDP:
#: ``tests/distributed/test_sharded_training.py``); a method opts out of one only with a
#: reason (:attr:`MethodEntry.opt_outs`), which the test prints.
PROPERTIES = ("micro_batching", "micro_batching_seedless", "sharded_equals_ddp", "autocast",
              "checkpoint_weights_only", "model_help_short", "model_help_accepted",
              "ddp_equals_one_process", "load_from_checkpoint", "exact_resume")
#: Crop sides of two 8 px views, and of 2 global 8 px + 2 local 4 px crops.
TWO_VIEWS, MULTI_CROP = (8, 8), (8, 8, 4, 4)
#: CLI arguments of the tiny config runs (:attr:`MethodEntry.cli_args`): a 2-stage SmallConvNet
#: for a config's ResNet-18, ...
SMALL_CONVNET_ARGS = ("--model.init_args.backbone", '{"class_path": "ssl_lightning.SmallConvNet", '
                      '"init_args": {"widths": [8, 16]}}')
#: ... a 1-block tiny ViT and small heads for the DINO family's ViT-S configs, ...
SMALL_DINO_ARGS = ("--model.init_args.backbone.init_args.depth", "1",
                   "--model.init_args.backbone.init_args.arch", "tiny",
                   "--model.init_args.head_out_dim", "64", "--model.init_args.patch_out_dim", "64",
                   "--model.init_args.head_hidden_dim", "32",
                   "--model.init_args.head_bottleneck_dim", "16")
#: ... and a small random timm DINOv2-style ViT teacher (the shipped one reads a weights file).
SMALL_TIMM_TEACHER_ARGS = (
    "--model.init_args.teacher", '{"class_path": "ssl_lightning.TimmBackbone", "init_args": '
    '{"name": "vit_small_patch14_dinov2.lvd142m", "model_kwargs": {"depth": 1, '
    '"embed_dim": 32, "num_heads": 2}, "pretrained_path": null}}',
    "--model.init_args.teacher_image_size", "28")

T = TypeVar("T", bound=type)


def small_convnet() -> SmallConvNet:
    """The small instances' ConvNet: 2 stages (8, 16 channels) with GroupNorm (float64-friendly,
    no batch statistics)."""
    return SmallConvNet((8, 16), norm="group")


def small_vit(**kwargs: Any) -> ViT:
    """The small instances' ViT: 8 px images, 2 px patches (a 4 x 4 grid), width 16, 1 block."""
    return ViT(**{"image_size": 8, "patch_size": 2, "embed_dim": 16, "depth": 1, "num_heads": 2,
                  **kwargs})


@dataclass(frozen=True)
class Paper:
    """The paper a method implements."""

    title: str
    year: int
    arxiv: str | None = None

    def __str__(self) -> str:
        return f"{self.title} ({self.year}" + (f", arXiv:{self.arxiv})" if self.arxiv else ")")


@dataclass(frozen=True)
class MethodEntry:
    """One registered method.

    Attributes:
        name: Registry name (snake case, e.g. ``"moco_v2"``).
        cls: The method class (a LightningModule users subclass).
        title: Display name (``"MoCo v2"``), as the README's method row and the docs write it.
        configs: Shipped config file names under ``configs/`` that train this class.
        paper: The paper it implements.
        family: Its family, for listings.
        views: Crop sides of the views the small instance takes, one per view.
        make: ``make(backbone, **kwargs)``: the small instance on ``backbone`` (small heads,
            float64-friendly); ``kwargs`` go to the constructor (``micro_batch_size``,
            optimiser settings). Use :meth:`small`.
        opt_outs: Property name (:data:`PROPERTIES`) -> why this method does not have it.
        docs: The docs page with a heading naming :attr:`title`.
        tests: Its own test file (under ``tests/``), which names the class.
        needs_sample_seeds: The loss reads dataset indices from the batches' sample seeds
            (batches without seeds are refused).
        backbone: The small instance's default backbone factory (:func:`small_convnet` unless
            the method needs a ViT, :func:`small_vit`).
        cli_args: Shipped config -> the CLI arguments that make it a seconds-long run on the
            tiny image folder of ``tests/product/test_configs.py`` (smaller backbone, heads,
            queues; ``()`` when it runs as shipped).
        matrix_args: Shipped config -> the CLI arguments the product matrix
            (``tests/product_matrix.py``) adds after its generic shrinking (backbone, head
            widths, data, trainer).
        position_keyed: A decision of the step depends on a sample's place in the global batch
            (sub-batches, stratified mask ratios, group updates, reference shuffles), keyed by
            its sampler position: checks against one process feed it the global batch in the
            samplers' order (rank r's sample j at j * world + r), not rank after rank.
    """

    name: str
    cls: type
    title: str
    configs: tuple[str, ...]
    paper: Paper
    family: Family
    views: tuple[int, ...]
    make: Callable[..., Any]
    opt_outs: Mapping[str, str] = field(default_factory=dict)
    docs: str = "docs/methods.md"
    tests: str = ""
    needs_sample_seeds: bool = False
    backbone: Callable[[], nn.Module] = small_convnet
    cli_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    matrix_args: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    position_keyed: bool = False

    def small(self, backbone: nn.Module | None = None, **kwargs: Any) -> Any:
        """The small instance, on ``backbone`` (e.g. a ViT for sharding) or its own."""
        return self.make(self.backbone() if backbone is None else backbone, **kwargs)

    def opt_out(self, prop: str) -> str | None:
        """The reason this method opts out of ``prop``, or None."""
        return self.opt_outs.get(prop)


_REGISTRY: dict[str, MethodEntry] = {}


def register_method(
    name: str, *, title: str, configs: tuple[str, ...], paper: Paper, family: Family,
    views: tuple[int, ...], small: Callable[..., Any], tests: str,
    opt_outs: Mapping[str, str] | None = None, docs: str = "docs/methods.md",
    needs_sample_seeds: bool = False, backbone: Callable[[], nn.Module] = small_convnet,
    cli_args: Mapping[str, tuple[str, ...]] | None = None,
    matrix_args: Mapping[str, tuple[str, ...]] | None = None, position_keyed: bool = False,
) -> Callable[[T], T]:
    """Class decorator: register the decorated method class under ``name`` (see
    :class:`MethodEntry` for the arguments) and return it unchanged.

    Raises:
        ValueError: ``name`` is taken by another class, an opt-out names an unknown property
            or has no reason, or ``cli_args`` / ``matrix_args`` name a config not in
            ``configs``.
    """
    for prop, reason in (opt_outs or {}).items():
        if prop not in PROPERTIES or not reason.strip():
            raise ValueError(f"{name}: opt-out {prop!r} must name one of {PROPERTIES} and give "
                             "a reason.")
    for config in (*(cli_args or {}), *(matrix_args or {})):
        if config not in configs:
            raise ValueError(f"{name}: CLI arguments for {config!r}, which is not one of its "
                             f"configs {configs}.")

    def register(cls: T) -> T:
        known = _REGISTRY.get(name)
        if known is not None and known.cls.__qualname__ != cls.__qualname__:
            raise ValueError(f"method name {name!r} is registered by {known.cls.__name__}; "
                             f"choose another name for {cls.__name__}.")
        _REGISTRY[name] = MethodEntry(name, cls, title, tuple(configs), paper, family,
                                      tuple(views), small, dict(opt_outs or {}), docs, tests,
                                      needs_sample_seeds, backbone, dict(cli_args or {}),
                                      dict(matrix_args or {}), position_keyed)
        return cls

    return register


def method_entries() -> list[MethodEntry]:
    """Every registered method, in registration (import) order."""
    import ssl_lightning.methods  # noqa: F401  (the method files register on import)

    return list(_REGISTRY.values())


def method_entry(name: str) -> MethodEntry:
    """The entry registered as ``name``.

    Raises:
        KeyError: naming the registered names.
    """
    entries = {entry.name: entry for entry in method_entries()}
    if name not in entries:
        raise KeyError(f"no method registered as {name!r}; registered: {sorted(entries)}.")
    return entries[name]
