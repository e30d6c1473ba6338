"""The xdist file order (``tests/file_order.py``): its recorded costs name files that exist, and
the hook puts the costliest file first, slow files before fast ones, keeping each file's tests
together and in their order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from file_order import FILE_CPU_S, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[2]


def test_every_recorded_file_exists() -> None:
    assert [name for name in FILE_CPU_S if not (ROOT / name).is_file()] == []


def test_costly_then_slow_then_the_rest_each_file_together() -> None:
    costly = max(FILE_CPU_S, key=FILE_CPU_S.__getitem__)

    def item(nodeid: str, slow: bool = False) -> SimpleNamespace:
        return SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda name: (
            pytest.mark.slow if slow and name == "slow" else None))

    items = [item("tests/a.py::t1"), item("tests/b.py::t1"), item("tests/b.py::t2", slow=True),
             item(f"{costly}::t1"), item("tests/a.py::t2"), item(f"{costly}::t2")]
    pytest_collection_modifyitems(None, None, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [f"{costly}::t1", f"{costly}::t2", "tests/b.py::t1",
                                         "tests/b.py::t2", "tests/a.py::t1", "tests/a.py::t2"]
