"""Old path of :mod:`ssl_lightning.queues.feature_queue`
(moved; this path warns with a ``FutureWarning``)."""

from ssl_lightning.compat.moved import warn_moved
from ssl_lightning.queues.feature_queue import *  # noqa: F401,F403

warn_moved(__name__, "ssl_lightning.queues.feature_queue")
