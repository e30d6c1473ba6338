"""Training callbacks: EMA teacher updates and evaluation (kNN, online linear probe)."""

__all__: list[str] = []
