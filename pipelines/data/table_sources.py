"""Reading `rtp prepare table`'s sources (pipelines/data/table.py): CSV, Parquet and HuggingFace `save_to_disk`
Arrow files, each file's used columns checked (errors name the file and its row) and turned into numpy arrays,
then all of them concatenated. Without --features, --image or --text the features are the first file's numeric
columns but the label, split and group ones."""
from __future__ import annotations

import argparse
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.data.idx import DataError
from pipelines.data.shards import sha256_of

SPLIT_NAMES = {"train": "train", "validation": "validation", "val": "validation", "valid": "validation",
               "dev": "validation", "test": "test"}
TABLE_SUFFIXES = (".csv", ".csv.gz", ".parquet")


def feature_columns(args: argparse.Namespace) -> tuple[str, ...]:
    """The feature columns the options name: none where they are the source's numeric columns (`numeric_columns`)."""
    return tuple(args.features or [column for column in (args.image or args.text,) if column])


def numeric_columns(table: pa.Table, path: Path, args: argparse.Namespace) -> list[str]:
    """Without --features, --image or --text, the features are every numeric (or boolean) column of the first file
    with rows, in its order, but the label, split and group columns and those of --features-except."""
    missing = [column for column in args.features_except if column not in table.column_names]
    if missing:
        raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (have {', '.join(table.column_names)})")
    left_out = [column for column in (args.label, args.split_column, args.group_by, *args.features_except) if column]
    found = [column.name for column in table.schema if column.name not in left_out and is_number(column.type)]
    if not found:
        raise DataError(f"{path}: no numeric column left to be the features (have {', '.join(table.column_names)}; "
                        f"left out: {', '.join(dict.fromkeys(left_out))}); name them with --features, or use --image "
                        f"or --text")
    return found


def sources_text(args: argparse.Namespace) -> str:
    return ", ".join(map(str, args.source))


@dataclass
class Sources:
    columns: dict[str, np.ndarray]  # features ([N, width], or N texts), label; split and group when there are
    sources: dict[str, str]         # file (relative to its --source's folder): sha256
    ignored_splits: list[str]       # a DatasetDict's split folders that are not train, validation or test
    class_names: list[str] | None   # a HuggingFace ClassLabel's names, by label value
    given_by: str | None            # what gives the splits: a column or a DatasetDict's folders
    feature_columns: tuple[str, ...]  # the source columns of the features: named, or every numeric one


def read_sources(args: argparse.Namespace, out: Path) -> Sources:
    """Every --source file's used columns, checked file by file (errors name the file and its row), then joined."""
    parts, sums, ignored, class_names = [], {}, [], None
    for source in args.source:
        files, skipped = source_files(source, out)
        ignored += skipped
        for path, split in files:
            table, key = read_table(path), path.relative_to(source.parent).as_posix()
            sums[str(path) if key in sums else key] = sha256_of(path)
            if table.num_rows:
                if not feature_columns(args):
                    args = argparse.Namespace(**{**vars(args), "features": numeric_columns(table, path, args)})
                parts.append(read_columns(table, path, split, args))
            class_names = class_names or class_label_names(path, args.label)
    if not parts:
        raise DataError(f"{sources_text(args)}: no rows")
    for key in parts[0]:
        if any(key not in part for part in parts) or len({part[key].dtype == object for part in parts}) > 1:
            raise DataError(f"{sources_text(args)}: the sources differ in their {key} column (split folders in some "
                            f"only, or text in some and numbers in others)")
    columns = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    given_by = args.split_column or ("split folders" if "split" in columns else None)
    return Sources(columns, sums, ignored, class_names, given_by, feature_columns(args))


def source_files(source: Path, out: Path) -> tuple[list[tuple[Path, str | None]], list[str]]:
    """The table files of one --source in reading order, each with the split its DatasetDict folder gives, and
    the DatasetDict's other split folders (left out). A folder's hidden files and `out` are not sources."""
    if not source.exists():
        raise DataError(f"{source}: not found")
    if (source / "dataset_dict.json").is_file():
        names = json.loads((source / "dataset_dict.json").read_text()).get("splits", [])
        files = [(path, SPLIT_NAMES[name]) for name in names if name in SPLIT_NAMES
                 for path in arrow_files(source / name)]
        return files, [name for name in names if name not in SPLIT_NAMES]
    if (source / "state.json").is_file() or (source / "dataset_info.json").is_file():
        return [(path, None) for path in arrow_files(source)], []
    if source.is_dir():
        files = sorted(path for path in source.rglob("*") if path.is_file() and path.name.endswith(TABLE_SUFFIXES)
                       and out not in path.resolve().parents
                       and not any(part.startswith(".") for part in path.relative_to(source).parts))
        if not files:
            raise DataError(f"{source}: no {', '.join(TABLE_SUFFIXES)} files in this folder")
        return [(path, None) for path in files], []
    if not source.name.endswith(TABLE_SUFFIXES):
        raise DataError(f"{source}: not a {', '.join(TABLE_SUFFIXES)} file nor a folder")
    return [(source, None)], []


def arrow_files(folder: Path) -> list[Path]:
    """A `save_to_disk` Dataset folder's Arrow files, in the order its state.json lists them."""
    state = folder / "state.json"
    names = [entry["filename"] for entry in json.loads(state.read_text()).get("_data_files", [])] \
        if state.is_file() else sorted(path.name for path in folder.glob("data-*.arrow"))
    missing = [name for name in names if not (folder / name).is_file()]
    if not names or missing:
        raise DataError(f"{folder}: no data-*.arrow files" if not names else f"{folder / missing[0]}: not found")
    return [folder / name for name in names]


def read_table(path: Path) -> pa.Table:
    """A CSV (empty and NA-like strings are nulls), Parquet or `datasets` Arrow file, whole."""
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".arrow":  # `datasets` writes IPC streams; an IPC file also works
            stream = pa.memory_map(str(path))
            try:
                return pa.ipc.open_stream(stream).read_all()
            except pa.ArrowInvalid:
                return pa.ipc.open_file(stream).read_all()
        if path.suffix == ".parquet":
            return pq.read_table(path)
        return pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(strings_can_be_null=True))
    except (OSError, pa.ArrowInvalid) as err:
        raise DataError(f"{path}: not a readable table ({' '.join(str(err).split())})") from err


def class_label_names(path: Path, label: str) -> list[str] | None:
    """The class names a HuggingFace ClassLabel column declares in the dataset_info.json beside its Arrow file."""
    info = path.parent / "dataset_info.json"
    if path.suffix != ".arrow" or not info.is_file():
        return None
    feature = json.loads(info.read_text()).get("features", {}).get(label)
    return feature.get("names") if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" else None


def read_columns(table: pa.Table, path: Path, split: str | None, args: argparse.Namespace) -> dict[str, np.ndarray]:
    """One file's used columns: present, without nulls, of the right kind."""
    used = [col for col in dict.fromkeys((*feature_columns(args), args.label, args.split_column, args.group_by)) if col]
    missing = [column for column in used if column not in table.column_names]
    if missing:
        raise DataError(f"{path}: no column {', '.join(map(repr, missing))} (have {', '.join(table.column_names)})")
    table = pa.table({name: column.cast(column.type.value_type) if pa.types.is_dictionary(column.type) else column
                      for name, column in zip(used, table.select(used).columns)})  # pandas categories: values
    for column in used:
        check_rows(pc.is_null(table.column(column), nan_is_null=True), f"{path}: column '{column}'", "null or NaN")
    columns = {"features": read_features(table, path, args), "label": read_labels(table, path, args)}
    if args.split_column:
        columns["split"] = read_splits(table.column(args.split_column), f"{path}: column '{args.split_column}'")
    elif split is not None:
        columns["split"] = np.full(table.num_rows, split, dtype=object)
    if args.group_by:
        columns["group"] = table.column(args.group_by).cast(pa.string()).to_numpy(zero_copy_only=False)
    return columns


def check_rows(bad: Any, where: str, what: str, values: Any = None) -> None:
    """A one-line error naming how many rows are `what` and the first (from 0; with its value, given `values`)."""
    bad = np.asarray(bad, dtype=bool)
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        value = "" if values is None else f": {values[first]!r}"
        raise DataError(f"{where}: {int(bad.sum())} rows are {what} (first: row {first}{value})")


def read_labels(table: pa.Table, path: Path, args: argparse.Namespace) -> np.ndarray:
    """The label values as read; classes are numbered once all files are read (`encode_labels`)."""
    kind = table.column(args.label).type
    kinds = (pa.types.is_integer, pa.types.is_floating) + \
        ((pa.types.is_boolean, is_text) if args.task == "classification" else ())
    if not any(is_kind(kind) for is_kind in kinds):
        raise DataError(f"{path}: column '{args.label}' holds {kind} values, not {args.task} labels "
                        f"({'numbers' if args.task == 'regression' else 'numbers, booleans or text'})")
    return table.column(args.label).to_numpy(zero_copy_only=False)


def read_splits(column: pa.ChunkedArray, where: str) -> np.ndarray:
    """Each row's split, from names in any case (val, valid, dev: validation); any other value is an error."""
    values = [str(value) for value in column.to_pylist()]
    names = np.asarray([value.strip().lower() for value in values], dtype=object)
    check_rows(~np.isin(names, list(SPLIT_NAMES)), where, "not train, validation (val, valid, dev) or test", values)
    return np.asarray([SPLIT_NAMES[name] for name in names], dtype=object)


def is_text(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def read_features(table: pa.Table, path: Path, args: argparse.Namespace) -> np.ndarray:
    """[N, width] numbers (float32) or pixels (uint8), or the N texts."""
    if args.features:
        return read_numeric(table, args.features, path)
    column, where = table.column(args.image or args.text), f"{path}: column '{args.image or args.text}'"
    if args.image:
        return read_images(column, path.parent, args.image_shape, where)
    if not is_text(column.type):
        raise DataError(f"{where}: holds {column.type} values, not text")
    return column.to_numpy(zero_copy_only=False)


def read_numeric(table: pa.Table, columns: list[str], path: Path) -> np.ndarray:
    wheres = [f"{path}: column '{column}'" for column in columns]
    if len(columns) == 1 and is_list(table.column(columns[0]).type):
        matrix = flatten_lists(table.column(columns[0]), wheres[0])[0].reshape(table.num_rows, -1)
    else:
        matrix = np.stack([numbers(table.column(column), where) for column, where in zip(columns, wheres)], axis=1)
    matrix = matrix.astype(np.float32)
    bad = ~np.isfinite(matrix)
    for i, where in enumerate(wheres):
        check_rows(bad[:, i] if len(columns) > 1 else bad.any(axis=1), where, "NaN or infinite (or beyond float32)")
    return matrix


def numbers(column: pa.ChunkedArray | pa.Array, where: str) -> np.ndarray:
    """A numeric or boolean column's values; any other column is an error (naming a text one's first non-number)."""
    if is_number(column.type):
        return column.to_numpy(zero_copy_only=False)
    values = column.to_pylist()
    for row, value in enumerate(values if is_text(column.type) else ()):
        try:
            float(value)
        except ValueError:
            raise DataError(f"{where}: holds text, not numbers (row {row}: {value!r})") from None
    raise DataError(f"{where}: holds {column.type} values, not numbers")


def flatten_lists(column: pa.ChunkedArray, where: str) -> tuple[np.ndarray, tuple[int, ...]]:
    """The numbers of a column of (nested) lists, flat, and the dims every row shares."""
    values, dims = column.combine_chunks(), []
    while is_list(values.type):
        lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
        if (lengths != lengths[0]).any():
            raise DataError(f"{where}: rows hold lists of unequal lengths ({lengths[0]} and "
                            f"{lengths[lengths != lengths[0]][0]} items at depth {len(dims)})")
        dims.append(int(lengths[0]))
        values = values.flatten()
    if values.null_count:
        raise DataError(f"{where}: {values.null_count} null values inside the lists")
    return numbers(values, where), tuple(dims)


def read_images(column: pa.ChunkedArray, base: Path, shape: tuple[int, ...], where: str) -> np.ndarray:
    """[N, H*W*C] uint8 pixels from pixel lists (flat or nested), encoded bytes, HuggingFace image structs
    ({'bytes', 'path'}) or file paths relative to the source file's folder."""
    kind = column.type
    if is_list(kind):
        pixels, dims = flatten_lists(column, where)
        if dims not in (shape, (int(np.prod(shape)),)):
            raise DataError(f"{where}: images are lists of shape {dims}, expected {shape} or {int(np.prod(shape))}")
        if pixels.dtype.kind not in "iu" or pixels.min() < 0 or pixels.max() > 255:
            raise DataError(f"{where}: pixels must be integers in 0..255, found {pixels.dtype} values "
                            f"{pixels.min()}..{pixels.max()}")
        return pixels.astype(np.uint8).reshape(len(column), -1)
    if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
        paths = pc.struct_field(column, "path").to_pylist() if kind.get_field_index("path") >= 0 \
            else [None] * len(column)
        items = [data if data is not None else name
                 for data, name in zip(pc.struct_field(column, "bytes").to_pylist(), paths)]
    elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or is_text(kind):
        items = column.to_pylist()
    else:
        raise DataError(f"{where}: holds {kind} values, not pixel lists, image bytes or image file paths")
    return np.stack([decode_image(item, base, shape, f"{where} row {row}") for row, item in enumerate(items)])


def decode_image(item: bytes | str | None, base: Path, shape: tuple[int, ...], where: str) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(item) if isinstance(item, bytes) else base / item) as image:
            mode, pixels = image.mode, np.asarray(image)
    except (OSError, ValueError, TypeError) as err:
        raise DataError(f"{where}: not a readable image ({err})") from err
    if pixels.shape != shape or pixels.dtype != np.uint8:
        raise DataError(f"{where}: a {mode} image of shape {pixels.shape} ({pixels.dtype}), expected {shape} uint8")
    return pixels.reshape(-1)
