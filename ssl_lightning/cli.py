"""LightningCLI wiring: ``python -m ssl_lightning fit --config configs/simclr.yaml``."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI

from ssl_lightning.methods import SSLMethod


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI; ``args`` replaces ``sys.argv[1:]`` (for tests)."""
    import ssl_lightning  # noqa: F401  (registers every public class for short class_path names)

    return LightningCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
    )
