"""Old path of :mod:`ssl_lightning.cli.pretrain`
(moved; this path warns with a ``FutureWarning``)."""

from ssl_lightning.cli.pretrain import *  # noqa: F401,F403
from ssl_lightning.compat.moved import warn_moved

warn_moved(__name__, "ssl_lightning.cli.pretrain")
