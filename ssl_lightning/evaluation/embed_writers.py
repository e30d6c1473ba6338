"""Output formats of ``python -m ssl_lightning embed``, each written chunk by chunk.

``.npy`` (float32 (N, D), with a ``<file>.paths.csv`` sidecar of ``path,label`` rows),
``.csv`` (``path,label,f0..f{D-1}``), ``.parquet`` (columns ``path``, ``label``, ``embedding``)
and ``.pt`` (``{"paths", "labels", "embeddings"}``; held in memory until saved, so prefer the
others for millions of images). CSV files are written by the :mod:`csv` module, which quotes a
path holding a comma, a quote, a tab or a line break, so every row reads back as written.

Rows of another shape than (D,) (``embed --patch-features``: an image's (h, w, C) feature map,
channels last) keep it in ``.npy`` (N, h, w, C) and ``.pt`` (``embeddings`` (N, h, w, C)); in
``.csv`` and ``.parquet`` a row is the map flattened in (h, w, C) order (columns ``f0`` ..
``f{h·w·C-1}``; a parquet file records ``row_shape`` ``"h,w,C"`` in its schema metadata).

Every file is written to a temporary name in the destination directory and renamed when it is
complete (:mod:`ssl_lightning.io.atomic`): an error, a full disk or an interrupt leaves an
existing output as it was.
"""

from __future__ import annotations

import csv
import os
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from ssl_lightning.io import atomic_open, atomic_path, atomic_torch_save

SUFFIXES = (".npy", ".csv", ".parquet", ".pt")


def check_output_suffix(output: str | os.PathLike) -> str:
    """The output's suffix, or a ``ValueError`` naming the supported ones."""
    suffix = Path(output).suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(
            f"Unsupported output suffix {suffix or '(none)'!r} of {os.fspath(output)!r}; "
            f"choose one of {', '.join(SUFFIXES)}."
        )
    if suffix == ".parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "Writing .parquet needs pyarrow: `pip install \"ssl_lightning[embed]\"`."
            ) from err
    return suffix


def sidecar_path(output: str | os.PathLike) -> Path:
    """``<output>.paths.csv``: the path and label of each ``.npy`` row (header ``path,label``)."""
    return Path(f"{os.fspath(output)}.paths.csv")


def read_sidecar(output: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """The paths and labels of a ``.npy`` output's rows, from its sidecar."""
    with open(sidecar_path(output), newline="", encoding="utf-8") as handle:
        rows = list(csv.reader(handle))[1:]
    return [r[0] for r in rows], np.array([int(r[1]) for r in rows], dtype=np.int64)


class EmbeddingWriter:
    """Appends ``(paths, labels, embeddings)`` chunks to ``output`` in its suffix's format; use
    as a context manager: the files appear, complete, when the block ends without an error.

    Args:
        output: Destination file; the format comes from its suffix.
        rows: Total number of rows that will be written (the ``.npy`` header needs it).
        dim: Embedding size (of a flattened row).
        row_shape: The shape of a row when it is not ``(dim,)``, e.g. ``(h, w, C)``.
    """

    def __init__(self, output: str | os.PathLike, rows: int, dim: int,
                 row_shape: tuple[int, ...] | None = None) -> None:
        self.output = Path(output)
        self.suffix = check_output_suffix(output)
        self.rows, self.dim, self.written = rows, dim, 0
        self.row_shape = tuple(row_shape or (dim,))
        if int(np.prod(self.row_shape)) != dim:
            raise ValueError(f"row_shape {self.row_shape} does not hold {dim} values.")
        self._pt: list[tuple[list[str], np.ndarray, np.ndarray]] = []
        self._stack = ExitStack()
        self._handle: Any = None
        self._csv: Any = None

    def __enter__(self) -> EmbeddingWriter:
        with ExitStack() as stack:  # closes what was opened if a later open fails
            if self.suffix == ".npy":
                self._handle = stack.enter_context(atomic_open(self.output, "wb"))
                np.lib.format.write_array_header_1_0(self._handle, {
                    "descr": np.lib.format.dtype_to_descr(np.dtype("<f4")),
                    "fortran_order": False, "shape": (self.rows, *self.row_shape)})
                self._csv = csv.writer(stack.enter_context(atomic_open(
                    sidecar_path(self.output), "w", newline="", encoding="utf-8")))
                self._csv.writerow(["path", "label"])
            elif self.suffix == ".csv":
                self._csv = csv.writer(stack.enter_context(
                    atomic_open(self.output, "w", newline="", encoding="utf-8")))
                self._csv.writerow(["path", "label", *(f"f{i}" for i in range(self.dim))])
            elif self.suffix == ".parquet":
                import pyarrow as pa
                import pyarrow.parquet as pq

                self._schema = pa.schema(
                    [("path", pa.string()), ("label", pa.int64()),
                     ("embedding", pa.list_(pa.float32(), self.dim))],
                    metadata={"row_shape": ",".join(map(str, self.row_shape))})
                tmp = stack.enter_context(atomic_path(self.output))
                self._handle = pq.ParquetWriter(tmp, self._schema)
            self._stack = stack.pop_all()
        return self

    def write(self, paths: list[str], labels: np.ndarray, embeddings: np.ndarray) -> None:
        """Append one chunk (rows in order)."""
        n = len(paths)
        if self.suffix == ".npy":
            self._handle.write(np.ascontiguousarray(embeddings, dtype="<f4").tobytes())
            self._csv.writerows([p, int(y)] for p, y in zip(paths, labels, strict=True))
        elif self.suffix == ".csv":
            for p, y, e in zip(paths, labels, embeddings.reshape(n, -1), strict=True):
                self._csv.writerow([p, int(y), *(repr(float(v)) for v in e)])
        elif self.suffix == ".parquet":
            import pyarrow as pa

            flat = pa.array(embeddings.astype(np.float32).reshape(-1), type=pa.float32())
            column = pa.FixedSizeListArray.from_arrays(flat, self.dim)
            table = pa.Table.from_arrays(
                [pa.array(paths, pa.string()), pa.array(labels.astype(np.int64)), column],
                schema=self._schema)
            self._handle.write_table(table)
        else:
            self._pt.append((list(paths), labels.copy(), embeddings.copy()))
        self.written += n

    def _finish(self) -> None:
        if self.written != self.rows:
            raise RuntimeError(f"wrote {self.written} rows of the announced {self.rows}.")
        if self.suffix == ".parquet":
            self._handle.close()
        elif self.suffix == ".pt":
            paths = [p for chunk in self._pt for p in chunk[0]]
            labels = np.concatenate([c[1] for c in self._pt]) if self._pt else np.zeros(0)
            embeddings = (np.concatenate([c[2] for c in self._pt]) if self._pt
                          else np.zeros((0, self.dim), np.float32))
            embeddings = embeddings.reshape(len(paths), *self.row_shape)
            atomic_torch_save({"paths": paths, "labels": torch.from_numpy(labels).long(),
                               "embeddings": torch.from_numpy(embeddings)}, self.output)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        """Finish the files and rename them into place, or, after an error, remove them."""
        if kind is None:
            with self._stack:
                self._finish()
        else:
            self._stack.__exit__(kind, error, traceback)
