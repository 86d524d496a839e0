"""Reading training data: rows, files, DataFrames, dicts of columns, Datasets and Hub ids into one ``Dataset``.

:func:`read_json_rows` reads ``.json``/``.jsonl`` files itself so a malformed line is reported with its
line number; :func:`rows_to_dataset` refuses non-dict rows and columns whose type changes from row to
row (naming the column and the rows); :func:`check_messages` finds conversations that would train
nothing or the wrong thing (no message list, non-string content, a last turn that is not the
assistant's, an assistant answer of ``None``) and refuses them, or drops and counts them on request.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from fastkit import _hf, _quiet
from fastkit.data.formats import map_columns, normalize_dataset
from fastkit.data.rules import _kind, _rows_named, check_rows, lone_surrogate, message_problem, row_problem
from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

JSON_SUFFIXES = (".json", ".jsonl")


_COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma"}
DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
"""File types the front door reads (each optionally ``.gz`` / ``.bz2`` / ``.xz`` compressed, not parquet)."""


def _data_suffix(path: Path) -> tuple[str, str | None]:
    """``(data suffix, compression module or None)`` of ``path``: ``d.jsonl.gz`` -> ``(".jsonl", "gzip")``."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = _COMPRESSED.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    return (suffixes[-1] if suffixes else ""), compression


def _read_bytes(path: Path, compression: str | None) -> bytes:
    import importlib

    if compression is None:
        return path.read_bytes()
    try:
        with importlib.import_module(compression).open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, ValueError) as exc:  # gzip.BadGzipFile, lzma.LZMAError are OSError / ValueError
        raise FastkitError(f"{path}: not a readable {compression} file ({exc}); compress it again or pass the "
                           "uncompressed file.") from exc


def _decode(path: Path, data: bytes) -> str:
    """The file's text; a non-UTF-8 byte is named by its line, so the user can find and fix it."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise FastkitError(f"{path}: line {line} is not UTF-8 (byte 0x{data[exc.start]:02x} at offset {exc.start}). "
                           "Re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8).") from exc


def read_rows(path: Path) -> list[Any]:
    """Rows of a ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file (optionally compressed); errors name the line."""
    suffix, compression = _data_suffix(path)
    if suffix not in DATA_SUFFIXES:
        raise FastkitError(f"{path}: fastkit reads {', '.join(DATA_SUFFIXES)} files (optionally .gz / .bz2 / .xz), "
                           f"not {''.join(path.suffixes) or 'a file without a suffix'!r}. Convert it to .jsonl.")
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError) as exc:
            raise FastkitError(f"{path}: not a readable parquet file ({exc}).") from exc
    text = _decode(path, _read_bytes(path, compression))
    if suffix == ".csv":
        return _csv_rows(path, text)
    return read_json_text(path, text, array=suffix == ".json")


def _csv_rows(path: Path, text: str) -> list[dict]:
    import csv
    import io

    reader = csv.DictReader(io.StringIO(text))
    rows = []
    try:
        for row in reader:
            if None in row:  # more fields than the header names
                raise FastkitError(f"{path}: line {reader.line_num} has more fields than the header "
                                   f"{reader.fieldnames}; quote fields that contain commas.")
            rows.append(row)
    except csv.Error as exc:
        raise FastkitError(f"{path}: line {reader.line_num} is not valid CSV ({exc}).") from exc
    if not reader.fieldnames:
        raise FastkitError(f"{path}: the CSV file is empty (no header line); give a header such as 'text' or "
                           "'prompt,completion'.")
    return rows


def read_table(path: Path):
    """``path`` read by ``datasets`` into an Arrow table (memory-mapped, cached by fingerprint), or None.

    None means the Python reader (:func:`read_rows`) must read the file: to name a bad line or row (invalid
    JSON, a row that is not an object, a column whose type changes from row to row, a non-UTF-8 byte), or
    because the file's form is one ``datasets`` reads differently (a ``.json`` object holding the list). The
    rows then go through the same checks; a file ``datasets`` reads whole is never read twice.
    """
    suffix, compression = _data_suffix(path)
    if suffix == ".json" and not _starts_with(path, compression, b"["):
        return None  # {"train": [...]}: one list inside an object, read by read_json_text
    builder, options = _ARROW_BUILDERS.get(suffix, (None, {}))
    if builder is None:
        return None
    if suffix != ".parquet" and not _is_utf8(path, compression):
        return None  # Arrow's JSON reader may let a bad byte through; the Python reader names its line
    if suffix == ".csv":
        options = _csv_options(path, compression)
        if options is None:
            return None
    try:
        with _quiet.datasets_reader_quiet():
            from datasets import load_dataset

            dataset = load_dataset(builder, data_files=str(path), split="train", **options)
    except Exception:  # noqa: BLE001 -- any reader failure: the Python reader names the line and the fix
        return None
    return None if _hf.has_json_feature(dataset.features) else dataset


_ARROW_BUILDERS = {".jsonl": ("json", {}), ".json": ("json", {}), ".csv": ("csv", {}), ".parquet": ("parquet", {})}
"""Data suffix -> (``datasets`` packaged builder, its options)."""


def _starts_with(path: Path, compression: str | None, prefix: bytes) -> bool:
    """Whether the file's first non-blank bytes (after a UTF-8 BOM) are ``prefix``."""
    import importlib

    opener = open if compression is None else importlib.import_module(compression).open
    try:
        with opener(path, "rb") as f:
            head = f.read(4096)
    except (OSError, EOFError, ValueError):
        return False
    return head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(prefix)


def _is_utf8(path: Path, compression: str | None, chunk: int = 1 << 22) -> bool:
    """Whether the whole file decodes as UTF-8, read a few MiB at a time (never the file in memory at once)."""
    import codecs
    import importlib

    decoder = codecs.getincrementaldecoder("utf-8")()
    opener = open if compression is None else importlib.import_module(compression).open
    try:
        with opener(path, "rb") as f:
            while block := f.read(chunk):
                decoder.decode(block)
            decoder.decode(b"", final=True)
    except (UnicodeDecodeError, OSError, EOFError, ValueError):
        return False
    return True


def _csv_options(path: Path, compression: str | None) -> dict | None:
    """``load_dataset("csv")`` options that read every cell as text, as ``csv.DictReader`` does (None: no header)."""
    import csv
    import importlib

    from datasets import Features, Value

    opener = open if compression is None else importlib.import_module(compression).open
    try:
        with opener(path, "rt", encoding="utf-8-sig", newline="") as f:
            header = next(csv.reader(f), None)
    except (OSError, EOFError, ValueError, UnicodeDecodeError, csv.Error):
        return None
    if not header or len(set(header)) != len(header) or not all(header):
        return None  # no header, or repeated / empty names: the Python reader says what it makes of them
    return {"features": Features({name: Value("string") for name in header}), "na_filter": False,
            "encoding": "utf-8-sig"}


def read_json_rows(path: Path) -> list[dict]:
    """Rows of a ``.json`` (array) or ``.jsonl`` (one object per line) file; a bad line is named by number."""
    suffix, compression = _data_suffix(path)
    return read_json_text(path, _decode(path, _read_bytes(path, compression)), array=suffix == ".json")


def read_json_text(path: Path, text: str, array: bool) -> list[Any]:
    if array and text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FastkitError(f"{path}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}. "
                               "Fix that line (a .json file is one JSON array of objects).") from exc
        if isinstance(data, dict):  # {"train": [...]} or {"data": [...]}: one list inside
            lists = [k for k, v in data.items() if isinstance(v, list)]
            if len(lists) != 1:
                raise FastkitError(f"{path}: a JSON object with keys {sorted(data)[:8]}; give a JSON array of "
                                   "examples (or one object holding exactly one list of them).")
            data = data[lists[0]]
        return data
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise FastkitError(f"{path}: line {number} is not valid JSON ({exc.msg}, column {exc.colno}). Each line "
                               "of a .jsonl file must be one complete JSON object; fix or remove that line.") from exc
    return rows


def rows_to_dataset(rows: Sequence[Any], where: str = "rows"):
    """A ``datasets.Dataset`` from dict rows; non-dict rows and mixed column types raise naming the rows."""
    from datasets import Dataset

    rows = list(rows)
    bad = [i for i, r in enumerate(rows) if not isinstance(r, dict)]
    if bad:
        raise FastkitError(f"{where}: row {bad[0] + 1} is a {type(rows[bad[0]]).__name__}, not a dict (rows "
                           f"{_rows_named(bad)}). Each example must be a dict such as "
                           "{'messages': [...]} or {'text': ...}.")
    kinds: dict[str, dict[str, list[int]]] = {}
    for i, row in enumerate(rows):
        for column, value in row.items():
            if value is not None:
                kinds.setdefault(column, {}).setdefault(_kind(value), []).append(i)
    for column, by_kind in kinds.items():
        if len(by_kind) > 1:  # the first row sets the type (dicts keep insertion order): name the others
            first, *others = by_kind
            odd = sorted(i for k in others for i in by_kind[k])
            raise FastkitError(f"{where}: column {column!r} mixes types: a {first} in row {by_kind[first][0] + 1}, "
                               f"a {_kind(rows[odd[0]][column])} in rows {_rows_named(odd)}. Give every row the "
                               "same type in a column (for chat content: a string).")
    for i, row in enumerate(rows):  # nested chat content: arrow would refuse mixed types without naming the row
        msgs = row.get("messages")
        for msg in msgs if isinstance(msgs, list) else []:
            content = msg.get("content") if isinstance(msg, dict) else None
            if not isinstance(msg, dict) or (content is not None and not isinstance(content, str)):
                raise FastkitError(f"{where}: row {i + 1}: {message_problem(msgs)}.")
    import pyarrow as pa

    try:
        return Dataset.from_list(rows)
    except UnicodeEncodeError as exc:  # a lone surrogate: Arrow's strings are UTF-8, which cannot hold one
        row = next((i for i, r in enumerate(rows) if _has_surrogate(r)), None)
        raise FastkitError(f"{where}: row {'?' if row is None else row + 1}: a text holds a lone surrogate character "
                           f"({ascii(exc.object[exc.start])}), which no tokenizer can encode (a badly decoded "
                           "emoji); fix the text, or drop the row.") from exc
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        _refuse_nested(rows, where)  # a nested field of the wrong type: name its row and field
        raise FastkitError(f"{where}: the rows do not form one table ({exc}); give every row the same fields with "
                           "the same types.") from exc


def _has_surrogate(value: Any) -> bool:
    """Whether any string inside ``value`` (dicts and lists walked) holds a lone surrogate."""
    if isinstance(value, str):
        return lone_surrogate(value) is not None
    if isinstance(value, dict):
        return any(_has_surrogate(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_surrogate(v) for v in value)
    return False


def as_dataset(source: Any, split: str = "train", where: str = "train_dataset"):
    """THE data front door: a ``datasets.Dataset`` from whatever the user brings, or a FastkitError naming it.

    Accepts a ``Dataset``, a ``DatasetDict`` (its ``split``), a list / tuple / generator of dict rows, a dict
    of columns (``{"text": [...]}``), a pandas ``DataFrame``, a path to a ``.jsonl`` / ``.json`` / ``.csv`` /
    ``.parquet`` file (optionally ``.gz`` / ``.bz2`` / ``.xz``), a folder written by ``save_to_disk`` or
    holding such files, or a Hub dataset id. Rows then go through the same checks whatever they came from.
    """
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    if source is None:
        raise FastkitError(f"{where} is None: give a list of examples, a file path (.jsonl/.json/.csv/.parquet), "
                           "a dict of columns, a DataFrame or a datasets.Dataset.")
    if isinstance(source, Dataset):
        return source
    if isinstance(source, DatasetDict):
        if split not in source:
            raise FastkitError(f"{where}: the DatasetDict has splits {sorted(source)}, not split={split!r}; pick "
                               f"one (e.g. dataset[{sorted(source)[0]!r}]).")
        return source[split]
    if isinstance(source, (IterableDataset, IterableDatasetDict)):
        raise FastkitError(f"{where} is a streaming (Iterable) dataset, and this step needs a Dataset (every row "
                           "measured first). make_trainer and fastkit train take a stream for SFT (rows checked as "
                           "drawn, max_steps); here give a Dataset (load_dataset(..., streaming=False) or "
                           "Dataset.from_list(list(dataset.take(n)))).")
    if isinstance(source, (str, os.PathLike)):
        return _from_path(str(source), split, where)
    if isinstance(source, dict):
        return _from_columns(source, where)
    if _hf.is_pandas_dataframe(source):  # pandas, without importing it
        rows = source.to_dict("records")
        return rows_to_dataset([{k: _none_if_nan(v) for k, v in r.items()} for r in rows], where=where)
    if isinstance(source, (list, tuple)) or isinstance(source, Iterator) or inspect.isgenerator(source):
        return rows_to_dataset(list(source), where=where)
    raise FastkitError(f"{where} is a {type(source).__name__}; give a list of dict rows, a dict of columns, a "
                       "DataFrame, a file path (.jsonl/.json/.csv/.parquet) or a datasets.Dataset.")


def _none_if_nan(value: Any) -> Any:
    return None if isinstance(value, float) and value != value else value  # pandas writes NaN for a missing cell


def _from_columns(columns: dict, where: str):
    lengths = {k: len(v) for k, v in columns.items() if isinstance(v, (list, tuple))}
    if not columns or len(lengths) < len(columns):
        not_lists = [k for k in columns if k not in lengths]
        raise FastkitError(f"{where}: a dict is read as columns ({{'text': [...]}}), but "
                           f"{(not_lists or ['(none)'])[0]!r} is not a list. For one example, pass a list: "
                           f"[{{...}}].")
    if len(set(lengths.values())) > 1:
        raise FastkitError(f"{where}: the columns have different lengths ({lengths}); give every column one value "
                           "per example.")
    names = list(columns)
    n = next(iter(lengths.values()))
    return rows_to_dataset([{k: columns[k][i] for k in names} for i in range(n)], where=where)


def _from_path(text: str, split: str, where: str):
    path = Path(os.path.expanduser(text))
    _check_regular(path, text, where)
    if path.is_file():
        _check_split_of_file(split, text, where)
        table = read_table(path)
        return table if table is not None else rows_to_dataset(read_rows(path), where=str(path))
    if path.is_dir():
        return _from_folder(path, split, where)
    suffix, _ = _data_suffix(path)
    if suffix in DATA_SUFFIXES or text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text:
        raise FastkitError(f"{where}: {text!r} does not exist (no such file or folder). Check the path; files "
                           f"fastkit reads: {', '.join(DATA_SUFFIXES)}.")
    from datasets import load_dataset

    try:
        return load_dataset(text, split=split)
    except Exception as exc:  # noqa: BLE001 -- every Hub failure (offline, missing, gated) becomes one message
        raise FastkitError(f"{where}: {text!r} is not a local file or folder, and loading it as a Hub dataset "
                           f"failed ({type(exc).__name__}: {str(exc)[:160]}). Pass a local file, or check the id "
                           "and that you are online (HF_HUB_OFFLINE).") from exc


def _check_regular(path: Path, text: str, where: str) -> None:
    """A path that exists but is neither a regular file nor a folder (``/dev/zero``, a FIFO, a socket, or a link
    to one) is refused as what it is: reading it would never end, or block."""
    if path.exists() and not path.is_file() and not path.is_dir():
        raise FastkitError(f"{where}: {text!r} is not a regular file (a device, pipe or socket, or a link to one); "
                           "point at a data file (.jsonl/.json/.csv/.parquet) or a folder of them.")


def _check_split_of_file(split: str, text: str, where: str) -> None:
    """One file holds one split: any ``split`` other than train would be read as the file's rows, silently."""
    if isinstance(split, str) and split.strip().lower() not in SPLIT_WORDS["train"]:
        raise FastkitError(f"{where}: split={split!r} was asked of the single file {text!r}, which holds one set of "
                           "rows; drop split= to train on it, or point at a folder with a file named for that split "
                           f"({split}.jsonl) or a Hub dataset.")


def _from_folder(path: Path, split: str, where: str):
    from datasets import load_from_disk

    if (path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists():
        return as_dataset(load_from_disk(str(path)), split, where)
    files = sorted(p for p in path.iterdir() if p.is_file() and _data_suffix(p)[0] in DATA_SUFFIXES)
    if not files:
        raise FastkitError(f"{where}: folder {str(path)!r} holds no data files ({', '.join(DATA_SUFFIXES)}) and is "
                           "not a saved dataset (save_to_disk); point at a file.")
    chosen = split_files(files, split, path, where)
    tables = [read_table(p) for p in chosen]
    if all(t is not None for t in tables):
        from datasets import concatenate_datasets

        try:  # one table when the files agree on their columns' types, else the rows name what differs
            return tables[0] if len(tables) == 1 else concatenate_datasets(tables)
        except ValueError:
            pass
    rows = [row for p in chosen for row in read_rows(p)]
    return rows_to_dataset(rows, where=str(path))


SPLIT_WORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "val", "dev"),
               "test": ("test", "testing", "eval", "evaluation")}
"""The words a data file's name holds to belong to a split (Hugging Face's convention for data folders)."""


def _split_of(file: Path) -> str | None:
    """The split ``file``'s name says (``train-00000.jsonl``, ``my_val.json``, ``data.test.csv``), or None."""
    words = set(re.split(r"[-._ 0-9]+", file.name.lower()))
    return next((split for split, names in SPLIT_WORDS.items() if words & set(names)), None)


def split_files(files: list[Path], split: str, folder: Path, where: str) -> list[Path]:
    """The files of ``folder`` that hold ``split``: those named for it; a folder with no split-named file at
    all is all ``train``. Otherwise a FastkitError listing the files (never another split's rows)."""
    if not isinstance(split, str) or not split.strip():
        raise FastkitError(f"{where}: split must be a split name such as 'train', got {split!r}.")
    asked = next((name for name, words in SPLIT_WORDS.items() if split.lower() in words), split.lower())
    named = {p: _split_of(p) for p in files}
    if not any(named.values()) and asked == "train":
        return files  # no file names a split: the whole folder is the training data
    chosen = [p for p in files if named[p] == asked or (named[p] is None and split.lower() in
                                                        re.split(r"[-._ 0-9]+", p.name.lower()))]
    if not chosen:
        listed = ", ".join(p.name for p in files[:8]) + (" ..." if len(files) > 8 else "")
        raise FastkitError(f"{where}: folder {str(folder)!r} has no file named for split={split!r} (its data files: "
                           f"{listed}). Name the file after the split (e.g. {asked}.jsonl), or point at the file "
                           "itself; fastkit does not read another split's rows in its place.")
    return chosen


def _refuse_nested(rows: list[dict], where: str) -> None:
    """Arrow could not build one table: when a row check explains why, raise with its rows and field."""
    from fastkit.data.formats import detect_format

    try:
        fmt = detect_format({k for r in rows for k in r})
    except FastkitError:
        return
    problems = [(i, why) for i, row in enumerate(rows) if (why := row_problem(fmt, row))]
    if problems:
        bad = [i for i, _ in problems]
        raise FastkitError(f"{where}: {len(bad)} of {len(rows)} rows cannot be trained (rows {_rows_named(bad)}); "
                           f"row {bad[0] + 1}: {problems[0][1]}. Fix those rows.")


def load_chat_dataset(source: str | Path | Sequence[dict] | Any, split: str = "train", normalize: bool = True,
                      columns: dict[str, str] | None = None, streaming: bool = False):
    """A ``datasets.Dataset`` from anything :func:`fastkit.data.read.as_dataset` reads (rows, a dict of
    columns, a DataFrame, a .jsonl / .json / .csv / .parquet file, a Dataset, a Hub id), rows checked.

    ``normalize=True`` detects the format and converts it (:func:`fastkit.data.formats.normalize_dataset`:
    ShareGPT ``conversations`` and Alpaca ``instruction``/``output`` become ``messages``; ``messages``,
    ``prompt``/``completion`` and ``text`` stay); data in none of these raises, naming the columns seen.
    ``columns`` maps your columns onto those fields first (``{"prompt": "question", "completion": "answer"}``,
    :func:`fastkit.data.formats.map_columns`). Several datasets: :func:`fastkit.data.load_sources`.

    ``streaming=True``: a ``datasets.IterableDataset`` read a few rows at a time (data larger than RAM or the disk;
    Hub datasets streamed), its format found and its first rows checked now, every row checked and tokenized as
    the trainer draws it (:mod:`fastkit.data.stream`; train it with ``max_steps``).
    """
    if streaming:
        return _load_stream(source, split, normalize, columns)
    dataset = as_dataset(source, split, where="dataset")
    if len(dataset) == 0:
        raise FastkitError("The training dataset is empty: give at least one example.")
    if columns is not None:
        dataset = map_columns(dataset, columns, where="dataset")
    return normalize_dataset(check_rows(dataset)) if normalize else dataset


def stream_source(source: Any, split: str = "train", where: str = "dataset"):
    """An ``IterableDataset`` of ``source``: an IterableDataset (its ``split`` of a dict), a file, a folder of files or
    a saved dataset, a Hub id (streamed), or anything :func:`fastkit.data.read.as_dataset` reads (in memory already:
    streamed from there)."""
    from datasets import Dataset, IterableDataset, IterableDatasetDict

    if isinstance(source, IterableDatasetDict):
        if split not in source:
            raise FastkitError(f"{where}: the IterableDatasetDict has splits {sorted(source)}, not split={split!r}.")
        return source[split]
    if isinstance(source, IterableDataset):
        return source
    if isinstance(source, Dataset):
        return source.to_iterable_dataset()
    if isinstance(source, (str, os.PathLike)):
        return _stream_path(os.fspath(source), split, where)
    return as_dataset(source, split, where).to_iterable_dataset()


def _stream_path(text: str, split: str, where: str):
    path = Path(os.path.expanduser(text))
    if path.is_dir() and not ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
        files = sorted(p for p in path.iterdir() if p.is_file() and _data_suffix(p)[0] in DATA_SUFFIXES)
        if not files:
            raise FastkitError(f"{where}: folder {str(path)!r} holds no data files ({', '.join(DATA_SUFFIXES)}).")
        return _stream_files(split_files(files, split, path, where), where)
    _check_regular(path, text, where)
    if path.is_file():
        _check_split_of_file(split, text, where)
        return _stream_files([path], where)
    if path.exists() or _data_suffix(path)[0] in DATA_SUFFIXES or text.startswith((".", "/", "~")):
        return as_dataset(text, split, where).to_iterable_dataset()  # a saved dataset, or its error message
    from datasets import load_dataset

    try:
        return load_dataset(text, split=split, streaming=True)
    except Exception as exc:  # noqa: BLE001 -- every Hub failure (offline, missing, gated) becomes one message
        raise FastkitError(f"{where}: {text!r} is not a local file or folder, and streaming it as a Hub dataset "
                           f"failed ({type(exc).__name__}: {str(exc)[:160]}). Pass a local file, or check the id "
                           "and that you are online (HF_HUB_OFFLINE).") from exc


def _stream_files(files: list[Path], where: str):
    """Data files of one type streamed by ``datasets``' packaged reader (a few rows in memory at a time)."""
    from datasets import load_dataset

    kinds = {_data_suffix(p) for p in files}
    suffix, compression = next(iter(kinds))
    if len({s for s, _ in kinds}) > 1:
        raise FastkitError(f"{where}: streaming reads files of one type at a time; these are "
                           f"{', '.join(sorted({s for s, _ in kinds}))}. Stream them as separate sources.")
    if suffix == ".json" and not _starts_with_array(files[0], compression):
        raise FastkitError(f"{where}: {files[0]} is one JSON object, not rows; streaming reads .jsonl (one row per "
                           "line), a .json array, .csv or .parquet. Load it without streaming.")
    empty = [p for p in files if p.stat().st_size == 0]
    if empty:
        raise FastkitError(f"{where}: {empty[0]} is empty (no rows); give at least one example.")
    options = _csv_options(files[0], compression) if suffix == ".csv" else {}
    builder = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}[suffix]
    try:
        with _quiet.datasets_reader_quiet():
            return load_dataset(builder, data_files=[str(p) for p in files], split="train", streaming=True,
                                **(options or {}))
    except Exception as exc:  # noqa: BLE001 -- a reader failure names the file; without streaming, the line
        raise FastkitError(f"{where}: {files[0]}{' ...' if len(files) > 1 else ''} could not be streamed "
                           f"({type(exc).__name__}: {str(exc)[:160]}). Load it without streaming to have the "
                           "bad line or row named.") from exc


def _starts_with_array(path: Path, compression: str | None) -> bool:
    return _starts_with(path, compression, b"[")


def _load_stream(source: Any, split: str, normalize: bool, columns: dict[str, str] | None):
    """:func:`load_chat_dataset`'s streamed form: columns mapped, the format known, the first rows checked."""
    from fastkit.data.stream import check_first_rows, stream_columns

    dataset = stream_source(source, split, where="dataset")
    if columns is not None:
        dataset = map_columns(dataset, columns, where="dataset", have=stream_columns(dataset))
    if normalize:
        check_first_rows(dataset, "dataset")
    return dataset


__all__ = ["as_dataset", "load_chat_dataset", "stream_source", "read_json_rows", "read_rows", "rows_to_dataset"]
