"""Load the backbone of a pre-training checkpoint, with errors that say what is wrong.

Used by evaluation (:mod:`ssl_lightning.evaluation.checkpoint` re-exports these names) and by
methods that start from a checkpoint's backbone (the teacher of
:class:`~ssl_lightning.methods.Distillation`), so it lives below both.

Every method in :mod:`ssl_lightning.methods` keeps its feature extractor in ``self.backbone`` and
saves its hyperparameters *without* it, so a checkpoint's ``state_dict`` holds the backbone under
``backbone.*``, and its class and arguments under ``backbone_spec`` (see
:mod:`ssl_lightning.backbones.spec`): :func:`backbone_from_checkpoint` rebuilds it from the file
alone. EMA methods also hold a teacher copy; pass its prefix (e.g. ``"teacher_backbone."``) to
evaluate the teacher instead.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from ssl_lightning.backbones.pretrained import state_differences
from ssl_lightning.backbones.spec import build_backbone
from ssl_lightning.compat.renamed import rename_state_keys, renamed_prefix
from ssl_lightning.distributed.sharding import (
    incomplete_checkpoint_directory,
    is_sharded_checkpoint,
    load_sharded_checkpoint,
)
from ssl_lightning.io.torch_files import load_torch_data

DEFAULT_PREFIX = "backbone."
#: The setting that chooses the prefix, as errors name it (the evaluation modules').
PREFIX_FLAG = "--model.checkpoint_prefix"
#: Checkpoint entry with the backbone's ``{"class_path", "init_args"}`` (written by SSLMethod).
SPEC_KEY = "backbone_spec"
#: What to do about a checkpoint that cannot be read.
CHECKPOINT_FIX = ("Pass a .ckpt written by `python -m ssl_lightning fit` (e.g. runs/<name>/"
                  "version_N/checkpoints/last.ckpt, or a best-*.ckpt beside it).")


def load_checkpoint(path: str | os.PathLike, what: str = "Checkpoint",
                    fix: str = CHECKPOINT_FIX) -> Mapping[str, Any]:
    """A Lightning checkpoint file (the whole dict), on the CPU; ``what`` (the file's role) and
    ``fix`` (what to do) go into the message of an unreadable file.

    The file is read with ``torch.load(weights_only=True)``: tensors and plain containers
    only, so a file that pickles other Python objects (which could run code) is refused. A
    sharded checkpoint directory (``ShardedStrategy``) is read whole, its shards assembled
    (:func:`ssl_lightning.distributed.sharding.load_sharded_checkpoint`).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: The file is not a torch file (empty, truncated, foreign), pickles Python
            objects, or is not a Lightning checkpoint (no ``state_dict``); a directory that is
            not a complete sharded checkpoint, or one whose files are refused or damaged.
    """
    path = os.fspath(path)
    if is_sharded_checkpoint(path):
        return load_sharded_checkpoint(path)
    if os.path.isdir(path):
        raise ValueError(incomplete_checkpoint_directory(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path!r}.")
    checkpoint: Any = load_torch_data(path, what, fix)
    if not isinstance(checkpoint, Mapping) or not isinstance(checkpoint.get("state_dict"), Mapping):
        found = sorted(checkpoint)[:8] if isinstance(checkpoint, Mapping) else type(checkpoint)
        raise ValueError(
            f"{path!r} is not a PyTorch Lightning checkpoint: it has no 'state_dict' entry "
            f"(found {found}). Pass the .ckpt written by `python -m ssl_lightning fit`."
        )
    return checkpoint


def load_checkpoint_state_dict(path: str | os.PathLike) -> dict[str, Tensor]:
    """The ``state_dict`` of a Lightning checkpoint file, on the CPU (see
    :func:`load_checkpoint`; same errors)."""
    return dict(load_checkpoint(path)["state_dict"])


def backbone_state_dict(
    path: str | os.PathLike, prefix: str = DEFAULT_PREFIX, flag: str = PREFIX_FLAG
) -> dict[str, Tensor]:
    """The backbone weights of a checkpoint, with ``prefix`` stripped from their names. Teacher
    prefixes resolve under their old names too (``key_backbone.``, ``target_backbone.``: see
    :mod:`ssl_lightning.compat.renamed`), in the request and in the checkpoint.

    Raises:
        FileNotFoundError, ValueError: See :func:`load_checkpoint_state_dict`; also a
            ``ValueError`` when no key starts with ``prefix`` (naming ``flag``, the setting that
        chooses the prefix, with the checkpoint's backbone prefixes).
    """
    state = load_checkpoint_state_dict(path)
    rename_state_keys(state)
    wanted = renamed_prefix(prefix)
    backbone = {k[len(wanted):]: v for k, v in state.items()
                if k.startswith(wanted) and wanted.endswith(".")}
    if not backbone:
        raise ValueError(_prefix_not_found(path, prefix, state, flag))
    return backbone


def _prefix_not_found(path: str | os.PathLike, prefix: str, state: Mapping[str, Any],
                      flag: str) -> str:
    """The message for a ``prefix`` that names no module of ``state``: the checkpoint's
    backbone prefixes (``backbone.``, ``teacher_backbone.``, ...), a close match, all prefixes."""
    tops = sorted({k.split(".", 1)[0] + "." for k in state})
    backbones = [top for top in tops if top.endswith("backbone.")]
    close = difflib.get_close_matches(prefix, tops, n=1, cutoff=0.6)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    if backbones:
        choice = (f"Its backbones are under {', '.join(map(repr, backbones))}: choose one "
                  f"with {flag} (e.g. {flag} {backbones[-1]}).")
    else:
        choice = ("It has no *backbone. prefix: is it a checkpoint of an ssl_lightning method? "
                  f"Choose the prefix of the backbone to evaluate with {flag}.")
    return (f"Checkpoint {os.fspath(path)!r} has no weights under {prefix!r} "
            f"({flag}).{hint} {choice} All its prefixes: {tops}.")


def check_compatible(module: nn.Module, state: Mapping[str, Tensor], source: str) -> None:
    """Raise a ``ValueError`` unless ``state`` fits ``module`` key for key and shape for shape.

    The message names the first mismatching key with both shapes, or the missing/unexpected keys.
    """
    expected = module.state_dict()
    key, missing, unexpected = state_differences(expected, state)
    if key is not None:
        raise ValueError(
            f"Backbone shape mismatch for {key!r}: the checkpoint {source} has "
            f"{tuple(state[key].shape)}, the configured backbone ({type(module).__name__}) has "
            f"{tuple(expected[key].shape)}. Configure the backbone the checkpoint was "
            "trained with."
        )
    if missing or unexpected:
        raise ValueError(
            f"The checkpoint {source} does not match the configured backbone "
            f"({type(module).__name__}): {len(missing)} missing keys {missing[:5]}, "
            f"{len(unexpected)} unexpected keys {unexpected[:5]}. Configure the backbone the "
            "checkpoint was trained with."
        )


def load_backbone(
    backbone: nn.Module, path: str | os.PathLike, prefix: str = DEFAULT_PREFIX,
    flag: str = PREFIX_FLAG
) -> nn.Module:
    """Copy the ``prefix`` weights of the checkpoint at ``path`` into ``backbone`` (strictly).

    Returns:
        ``backbone``, loaded in place.

    Raises:
        FileNotFoundError: Missing file.
        ValueError: Not a Lightning checkpoint, no ``prefix`` keys, or a key/shape mismatch.
    """
    state = backbone_state_dict(path, prefix, flag)
    check_compatible(backbone, state, f"{os.fspath(path)!r}")
    backbone.load_state_dict(state)
    return backbone


def backbone_from_checkpoint(
    path: str | os.PathLike, backbone: nn.Module | None = None, prefix: str = DEFAULT_PREFIX,
    flag: str = PREFIX_FLAG
) -> nn.Module:
    """The backbone of a checkpoint, loaded: ``backbone`` when given (an override), else the
    module the checkpoint's ``backbone_spec`` describes.

    Raises:
        ValueError: No ``backbone`` given and the checkpoint has no spec (written by a foreign
            backbone class from Python), plus the errors of :func:`load_backbone`.
    """
    if backbone is None:
        spec = load_checkpoint(path).get(SPEC_KEY)
        if not isinstance(spec, Mapping):
            raise ValueError(
                f"Checkpoint {os.fspath(path)!r} does not record its backbone class (it was "
                "written with a backbone that is not an ssl_lightning class, outside the CLI). "
                "Give the backbone explicitly (--model.backbone / backbone=...)."
            )
        if prefix != DEFAULT_PREFIX and not prefix.endswith("backbone."):
            # a prefix that names nothing: list the prefixes
            backbone_state_dict(path, prefix, flag)
            raise ValueError(
                f"The checkpoint's spec describes its backbone, not the module under "
                f"{prefix!r}; give that module explicitly."
            )
        backbone = build_backbone(spec, source=f"Checkpoint {os.fspath(path)!r}")
    return load_backbone(backbone, path, prefix, flag)
