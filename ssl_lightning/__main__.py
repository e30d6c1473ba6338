"""``python -m ssl_lightning fit --config configs/simclr.yaml``."""

from ssl_lightning.cli import main

if __name__ == "__main__":
    main()
