"""Third-party warnings the command line hides: each names a call inside a library, not in the
user's config or code, so the user can do nothing about it, and it came before the run's own
summary. ``KNOWN_WARNINGS`` lists them, one line of why each; nothing else is filtered, and
``python -W ...`` or ``PYTHONWARNINGS`` (which set ``sys.warnoptions``) turn the filtering off.
"""

from __future__ import annotations

import sys
import warnings

#: (message pattern, category, pattern of the module the warning is attributed to, why).
KNOWN_WARNINGS: tuple[tuple[str, type[Warning], str, str], ...] = (
    ("'set_vital' is deprecated", UserWarning, r"torchdata\.stateful_dataloader",
     "torchdata's StatefulDataLoader (the resumable loader) calls torch.set_vital in its "
     "constructor, which torch deprecated; harmless, and only a torchdata release removes it"),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning,
     r"(pytorch_lightning|lightning\.pytorch)\.utilities\._pytree",
     "Lightning's own pytree helper builds a LeafSpec when it moves a batch, which torch "
     "deprecated; harmless, and only a Lightning release removes it"),
    (r"torch\.distributed\.nn\.functional\.all_gather is deprecated", FutureWarning,
     r"(lightning_fabric|lightning\.fabric)\.utilities\.distributed",
     "Lightning's all_gather(sync_grads=True) (LightningModule.all_gather, the sharded runs' "
     "gathers) calls torch's deprecated differentiable all_gather; harmless, and only a "
     "Lightning release removes it"),
)


def quiet_known_warnings() -> None:
    """Ignore :data:`KNOWN_WARNINGS` in this process, unless the user asked for warnings with
    ``-W`` / ``PYTHONWARNINGS``."""
    if sys.warnoptions:
        return
    for message, category, module, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
