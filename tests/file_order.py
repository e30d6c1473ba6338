"""The order the test files run in, so that pytest-xdist's ``--dist loadfile`` balances its
workers: the costliest files first (longest first: the cheap files fill the gaps at the end),
then the other files with a test marked slow, then the rest, each group in collection order.
The scheduler hands out whole files in this order (``--no-loadscope-reorder`` in pyproject's
``addopts`` keeps it; xdist would otherwise order files by their number of tests). The hook here
is imported by ``tests/conftest.py``; the order changes which worker runs a file, never a result.
"""

from __future__ import annotations

import pytest

#: CPU seconds (user + system, with the processes it starts) of the costliest files, measured
#: with ``/usr/bin/time -v python -m pytest -q -n 0 FILE``; an unlisted file counts as cheap.
#: Re-measure a file when a change makes it much cheaper or dearer.
FILE_CPU_S: dict[str, float] = {
    "tests/product/test_product_matrix.py": 206.0,
    "tests/distributed/test_sharded_training.py": 61.5,
    "tests/resume/test_resume_exact.py": 39.4,
    "tests/distributed/test_sample_rng_ddp.py": 32.0,
    "tests/product/test_benchmark_suite.py": 30.4,
    "tests/evaluation/test_embedding_plot.py": 27.0,
    "tests/distributed/test_multinode_cli.py": 26.0,
    "tests/resume/test_resume_ddp.py": 20.4,
    "tests/evaluation/test_probe_grid.py": 11.0,
}


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """Costly files first, then files with a slow test, then the rest (a stable sort, so the
    tests of a file stay together and in their order)."""
    slow_files = {_file(item) for item in items if item.get_closest_marker("slow")}
    position = {}
    for item in items:
        position.setdefault(_file(item), len(position))

    def key(item: pytest.Item) -> tuple[float, bool, int]:
        name = _file(item)
        return (-FILE_CPU_S.get(name, 0.0), name not in slow_files, position[name])

    items.sort(key=key)
