"""Raw input for prediction (`pipelines.predict`), read and checked before anything starts: images from an IDX
file or a folder of image files, texts from a text file, a CSV/Parquet file or a folder of .txt files, numeric
features from the named columns of a CSV/Parquet file. Each reader returns (source of each row, rows); a bad input
raises DataError with one line."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa

from pipelines.data.idx import DataError, read_idx

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".pgm", ".tif", ".tiff")


def read_images(path: Path, shape: tuple[int, ...] = (28, 28)) -> tuple[list[str], np.ndarray]:
    """An IDX images file ([N, H, W] unsigned bytes, gzipped or not; grayscale models), or a folder of image files
    (sorted by name; any size and colour, converted to the model's `shape`: (H, W) grayscale, (H, W, 3) RGB; MNIST
    digits are white on black). Returns (row sources, uint8 images [N, H * W (* C)])."""
    if not path.exists():
        raise DataError(f"{path}: not found")
    width = int(np.prod(shape))
    if path.is_file():
        images = read_idx(path, expected_ndim=3)
        if images.shape[1:] != tuple(shape):
            raise DataError(f"{path}: images of {'x'.join(map(str, images.shape[1:]))}, not "
                            f"{'x'.join(map(str, shape))}")
        return [f"{path.name}[{i}]" for i in range(len(images))], images.reshape(len(images), width)
    from PIL import Image, UnidentifiedImageError

    files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    _require_rows(path, files, f"image files ({', '.join(IMAGE_SUFFIXES)})")
    rows, mode = [], "L" if len(shape) == 2 else {1: "L", 3: "RGB", 4: "RGBA"}[shape[2]]
    for file in files:
        try:
            with Image.open(file) as image:
                resized = image.convert(mode).resize((shape[1], shape[0]))
                rows.append(np.asarray(resized, dtype=np.uint8).reshape(width))
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"{file}: not a readable image ({type(err).__name__})") from err
    return [str(f.relative_to(path)) for f in files], np.stack(rows)


def read_texts(path: Path, column: str = "text",
               clean: Callable[[str], str] = str.strip) -> tuple[list[str], list[str]]:
    """Texts: a .txt file (one per line; blank lines separate, they are no text), a .csv or .parquet file (a
    `column` column), or a folder of .txt files
    (one text each, sorted by path; an aclImdb folder works: its `urls_*.txt` lists are not reviews). Each cleaned
    by `clean`, as the training data's preparation cleaned its texts (`DatasetSpec.clean_text`); empty ones are an
    error (the model would score nothing)."""
    if not path.exists():
        raise DataError(f"{path}: not found")
    if path.is_dir():
        files = sorted(f for f in path.rglob("*.txt") if not f.name.startswith("urls_"))
        _require_rows(path, files, ".txt files")
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        sources = [str(f.relative_to(path)) for f in files]
    elif path.suffix in (".csv", ".parquet"):
        texts = [str(value) if value is not None else "" for value in _table(path, [column])[column]]
        sources = [f"{path.name}[{i}]" for i in range(len(texts))]
    else:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        numbered = [(f"{path.name}:{i + 1}", line) for i, line in enumerate(lines) if line.strip()]
        sources, texts = [source for source, _ in numbered], [line for _, line in numbered]
    cleaned = [clean(text or "") for text in texts]
    empty = [source for source, text in zip(sources, cleaned) if not text]
    if empty or not cleaned:
        raise DataError(f"{path}: {len(empty)} empty review(s) (first: {empty[0]})" if empty else
                        f"{path}: no reviews")
    return sources, cleaned


def read_numeric(path: Path, columns: tuple[str, ...]) -> tuple[list[str], np.ndarray]:
    """Numeric features: the `columns` (the training data's, in its order) of a .csv or .parquet file, as float32
    [N, len(columns)]; a missing column, a missing or non-numeric value is an error naming it."""
    if not path.is_file() or path.suffix not in (".csv", ".parquet"):
        raise DataError(f"{path}: not a .csv or .parquet file (numeric features are read from a table)")
    table = _table(path, list(columns))
    values = np.empty((len(next(iter(table.values()))), len(columns)), dtype=np.float32)
    for i, column in enumerate(columns):
        try:
            values[:, i] = np.asarray(table[column], dtype=np.float64)
        except (TypeError, ValueError) as err:
            raise DataError(f"{path}: column '{column}' is not numeric ({err})") from err
        if np.isnan(values[:, i]).any():
            raise DataError(f"{path}: column '{column}' has {int(np.isnan(values[:, i]).sum())} missing value(s)")
    if not len(values):
        raise DataError(f"{path}: no rows")
    return [f"{path.name}[{i}]" for i in range(len(values))], values


def _table(path: Path, columns: list[str]) -> dict[str, list]:
    """The `columns` of a .csv or .parquet file, as Python lists (None for a missing value)."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path) if path.suffix == ".parquet" else pacsv.read_csv(path)
    except (OSError, pa.ArrowInvalid) as err:
        raise DataError(f"{path}: not a readable {path.suffix[1:]} file ({str(err).splitlines()[0]})") from err
    missing = [column for column in columns if column not in table.column_names]
    if missing:
        raise DataError(f"{path}: no column {', '.join(repr(c) for c in missing)} (have {table.column_names})")
    return {column: [None if v is None else v for v in table.column(column).to_pylist()] for column in columns}


def _require_rows(path: Path, files: list[Path], what: str) -> None:
    if not files:
        raise DataError(f"{path}: no {what} in this folder")
