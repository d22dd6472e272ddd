"""Streamed reads in the test's own process: what Ray Data's read tasks do (trainers/streamed.py `file_rows`) to
files a test holds."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from trainers.streamed import Columns, FileRead, RankPart, Reader, RowPrep, WindowFill, file_rows


def in_process(read_files: Callable[[list[str], list[str]], Iterable[Columns]]) -> Reader:
    """A `StreamedRows` reader over `read_files(paths, columns)`, which gives the files' rows in file order, in blocks
    of any size: each file's rows made in this process as a read task makes them."""
    def read(reads: list[FileRead], columns: list[str], part: RankPart | None, prep: RowPrep) -> Iterator[Columns]:
        blocks = WindowFill(iter(read_files([r.path for r in reads], columns)))
        for file in reads:
            held = blocks.take(file.file_rows)
            yield file_rows(lambda rows: held if rows is None else {c: v[rows] for c, v in held.items()}, file, part,
                            prep)
    return read
