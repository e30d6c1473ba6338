"""Output formats of ``python -m ssl_lightning embed``, each written chunk by chunk.

``.npy`` (float32 (N, D), with a ``<file>.paths.tsv`` sidecar of ``path<TAB>label`` lines),
``.csv`` (``path,label,f0..f{D-1}``), ``.parquet`` (columns ``path``, ``label``, ``embedding``)
and ``.pt`` (``{"paths", "labels", "embeddings"}``; held in memory until saved, so prefer the
others for millions of images).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

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


class EmbeddingWriter:
    """Appends ``(paths, labels, embeddings)`` chunks to ``output`` in its suffix's format.

    Args:
        output: Destination file; the format comes from its suffix.
        rows: Total number of rows that will be written (the ``.npy`` header needs it).
        dim: Embedding size.
    """

    def __init__(self, output: str | os.PathLike, rows: int, dim: int) -> None:
        self.output = Path(output)
        self.suffix = check_output_suffix(output)
        self.output.parent.mkdir(parents=True, exist_ok=True)
        self.rows, self.dim, self.written = rows, dim, 0
        self._pt: list[tuple[list[str], np.ndarray, np.ndarray]] = []
        self._handle: Any = None
        if self.suffix == ".npy":
            self._array = np.lib.format.open_memmap(
                self.output, mode="w+", dtype=np.float32, shape=(rows, dim))
            self._handle = open(self.sidecar_path(self.output), "w", encoding="utf-8")
        elif self.suffix == ".csv":
            self._handle = open(self.output, "w", newline="", encoding="utf-8")
            self._csv = csv.writer(self._handle)
            self._csv.writerow(["path", "label", *(f"f{i}" for i in range(dim))])
        elif self.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            self._schema = pa.schema([("path", pa.string()), ("label", pa.int64()),
                                      ("embedding", pa.list_(pa.float32(), dim))])
            self._handle = pq.ParquetWriter(self.output, self._schema)

    @staticmethod
    def sidecar_path(output: str | os.PathLike) -> Path:
        """``<output>.paths.tsv``: the path and label of each ``.npy`` row."""
        return Path(f"{os.fspath(output)}.paths.tsv")

    def write(self, paths: list[str], labels: np.ndarray, embeddings: np.ndarray) -> None:
        """Append one chunk (rows in order)."""
        n = len(paths)
        if self.suffix == ".npy":
            self._array[self.written:self.written + n] = embeddings
            self._handle.writelines(f"{p}\t{int(y)}\n" for p, y in zip(paths, labels, strict=True))
        elif self.suffix == ".csv":
            for p, y, e in zip(paths, labels, embeddings, strict=True):
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

    def close(self) -> None:
        """Finish the file (flush, footer, or the ``.pt`` save)."""
        if self.written != self.rows:
            raise RuntimeError(f"wrote {self.written} rows of the announced {self.rows}.")
        if self.suffix == ".npy":
            self._array.flush()
            del self._array
        if self.suffix == ".pt":
            paths = [p for chunk in self._pt for p in chunk[0]]
            labels = np.concatenate([c[1] for c in self._pt]) if self._pt else np.zeros(0)
            embeddings = (np.concatenate([c[2] for c in self._pt]) if self._pt
                          else np.zeros((0, self.dim), np.float32))
            torch.save({"paths": paths, "labels": torch.from_numpy(labels).long(),
                        "embeddings": torch.from_numpy(embeddings)}, self.output)
        if self._handle is not None:
            self._handle.close()
