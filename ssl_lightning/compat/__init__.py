"""Old names accepted with a ``FutureWarning`` for one release: renamed constructor arguments
and teacher state-dict prefixes (:mod:`ssl_lightning.compat.renamed`)."""
