"""Raw input for prediction (`pipelines.predict`), read and checked before anything starts: MNIST-style images
from an IDX file or a folder of image files, reviews from a text file, a CSV/Parquet file or a folder of .txt
files. Each reader returns (source of each row, rows); a bad input raises DataError with one line."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from pipelines.data.idx import DataError, read_idx
from pipelines.data.imdb import clean_text

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".pgm", ".tif", ".tiff")


def read_images(path: Path) -> tuple[list[str], np.ndarray]:
    """An IDX images file ([N, 28, 28] unsigned bytes, gzipped or not), or a folder of image files (sorted by
    name; any size and colour, converted to 28x28 grayscale; MNIST digits are white on black). Returns (row
    sources, uint8 images [N, 784])."""
    if not path.exists():
        raise DataError(f"{path}: not found")
    if path.is_file():
        images = read_idx(path, expected_ndim=3)
        if images.shape[1:] != (28, 28):
            raise DataError(f"{path}: images of {images.shape[1]}x{images.shape[2]}, not 28x28")
        return [f"{path.name}[{i}]" for i in range(len(images))], images.reshape(len(images), 784)
    from PIL import Image, UnidentifiedImageError

    files = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    _require_rows(path, files, f"image files ({', '.join(IMAGE_SUFFIXES)})")
    rows = []
    for file in files:
        try:
            with Image.open(file) as image:
                rows.append(np.asarray(image.convert("L").resize((28, 28)), dtype=np.uint8).reshape(784))
        except (OSError, UnidentifiedImageError) as err:
            raise DataError(f"{file}: not a readable image ({type(err).__name__})") from err
    return [str(f.relative_to(path)) for f in files], np.stack(rows)


def read_texts(path: Path) -> tuple[list[str], list[str]]:
    """Reviews: a .txt file (one per line), a .csv or .parquet file (a `text` column), or a folder of .txt files
    (one review each, sorted by path; an aclImdb folder works: its `urls_*.txt` lists are not reviews). Cleaned
    as `prepare imdb` cleans them; empty ones are an error (the model would score nothing)."""
    if not path.exists():
        raise DataError(f"{path}: not found")
    if path.is_dir():
        files = sorted(f for f in path.rglob("*.txt") if not f.name.startswith("urls_"))
        _require_rows(path, files, ".txt files")
        texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        sources = [str(f.relative_to(path)) for f in files]
    elif path.suffix in (".csv", ".parquet"):
        texts = _text_column(path)
        sources = [f"{path.name}[{i}]" for i in range(len(texts))]
    else:
        texts = path.read_text(encoding="utf-8", errors="replace").splitlines()
        sources = [f"{path.name}:{i + 1}" for i in range(len(texts))]
    cleaned = [clean_text(text or "") for text in texts]
    empty = [source for source, text in zip(sources, cleaned) if not text]
    if empty or not cleaned:
        raise DataError(f"{path}: {len(empty)} empty review(s) (first: {empty[0]})" if empty else
                        f"{path}: no reviews")
    return sources, cleaned


def _text_column(path: Path) -> list[str]:
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path) if path.suffix == ".parquet" else pacsv.read_csv(path)
    except (OSError, pa.ArrowInvalid) as err:
        raise DataError(f"{path}: not a readable {path.suffix[1:]} file ({str(err).splitlines()[0]})") from err
    if "text" not in table.column_names:
        raise DataError(f"{path}: no 'text' column (have {table.column_names})")
    return [str(value) if value is not None else "" for value in table.column("text").to_pylist()]


def _require_rows(path: Path, files: list[Path], what: str) -> None:
    if not files:
        raise DataError(f"{path}: no {what} in this folder")
