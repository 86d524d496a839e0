"""Several datasets in one run, each with its own path, split, column mapping, weight and row cap.

A :class:`DataSource` names one dataset (a Hub id, a file, a folder, or the offline names ``"sample"`` and
``"quickstart"``, :mod:`fastkit.data.samples`); :meth:`DataSource.parse` reads the CLI / YAML string form
(``qa.csv?columns=prompt:question,completion:answer&weight=2&max_rows=500``) and :meth:`DataSource.from_mapping`
a YAML entry. :func:`load_sources` reads every source through the one front door
(:func:`fastkit.data.read.as_dataset`), maps its columns, checks its rows (errors name the source), normalizes it
(ShareGPT / Alpaca -> ``messages``), brings the sources to one common form and mixes them, seeded.

Weights, precisely: every row of every source is used once by default. A source's ``weight`` repeats its rows:
``weight=2`` uses each row twice, ``weight=1.5`` each row once plus a seeded half of them again, ``weight=0.5`` a
seeded half of its rows (``round(n * weight)`` rows of the ``n`` it has after its ``max_rows`` cap: every row as
many whole times as fit, plus a seeded sample for the rest). A weight changes its own source only; other sources
keep all their rows. Several sources are shuffled together (seeded); one source keeps its order.

The common form: a mix of ``messages`` chats and ``prompt``/``completion`` rows becomes ``messages`` (a string
prompt + completion becomes one user turn + one assistant turn; a message-list prompt + completion is joined);
string and message-list prompt/completion rows become message lists; ``text`` rows (plain language modeling)
and pre-tokenized rows mix only with their own kind, other mixes are refused naming both sources.

Shares instead of repeats: ``mix="interleave_under"`` / ``"interleave_over"`` (``--data-mix``, :data:`MIXES`)
interleave the sources, each next row drawn from a source with probability proportional to its weight.

Streamed (``load_sources(..., streaming=True)``, ``--streaming``): each source is read a few rows at a time
(:mod:`fastkit.data.stream`), so no source's length is known and a weight cannot repeat rows. There a weight is a
share: several streams are interleaved, each next row drawn from a source with probability proportional to its
weight (1 by default; seeded), until every source has been read to its end once (``datasets.interleave_datasets``,
``all_exhausted``: a shorter source starts again meanwhile); ``max_rows`` takes a source's first rows. Streamed
sources share one format (the one row rule and tokenization a stream applies). A stream's ``concat`` is
``interleave_over`` (a stream cannot repeat rows it has not read); ``interleave_under`` stops at the first source's
end.
"""

from __future__ import annotations

import logging
import math
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from fastkit.data.formats import FIELDS, check_columns, map_columns, normalize_dataset
from fastkit.data.rules import check_rows
from fastkit.data.samples import OFFLINE_NAMES, offline_source
from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

MIXES = ("concat", "interleave_under", "interleave_over")
"""How several sources mix (LLaMA-Factory's names): ``concat`` uses every row of every source (a weight repeats or
samples its source's rows) and shuffles them together; ``interleave_under`` / ``interleave_over`` draw each next row
from a source with probability proportional to its weight (a share; 1 by default), seeded, until the first source
runs out (under-sampling the larger ones) / until every source has run out once (the smaller ones start again)."""
STOPPING = {"interleave_under": "first_exhausted", "interleave_over": "all_exhausted"}
"""``datasets.interleave_datasets``' stopping strategy of each interleaving mix."""
DEFAULT_SEED = 3407
"""The seed :func:`load_sources` samples and shuffles with unless told otherwise (fastkit's training seed)."""
QUERY_KEYS = ("columns", "weight", "max_rows", "split", "name")
"""Keys of a source string's query part (``path?key=value&...``); ``max-rows`` is read as ``max_rows``."""


@dataclass
class DataSource:
    """One dataset of a run: where it is, which split, how its columns map, and how often its rows are used."""

    path: Any
    """A Hub dataset id, a ``.jsonl`` / ``.json`` / ``.csv`` / ``.parquet`` file, a folder, or an offline name
    (``"sample"``, ``"quickstart"``). From Python also anything :func:`fastkit.data.read.as_dataset` reads (a
    ``Dataset``, a list of dict rows, a DataFrame)."""
    split: str = "train"
    """The split to read (of a Hub dataset, a ``DatasetDict`` or a folder of split-named files)."""
    columns: dict[str, str] | None = None
    """fastkit field -> the data's column, e.g. ``{"prompt": "question", "completion": "answer"}``. Fields:
    :data:`fastkit.data.formats.FIELDS`. None: the columns are already named like one of the formats."""
    weight: float | None = None
    """How many times each row is used: 2 = every row twice, 0.5 = a seeded half of the rows (the module
    docstring says exactly how rows are drawn); None: every row once (as 1)."""
    max_rows: int | None = None
    """Use at most this many rows of the source (a seeded sample, in the file's order), before mixing."""
    name: str | None = None
    """What log lines and errors call the source; the path when None."""

    def __post_init__(self) -> None:
        where = f"data source {self.label!r}"
        if self.path is None or (isinstance(self.path, str) and not self.path.strip()):
            raise FastkitError(f"{where}: path is empty; give a file, a folder, a Hub dataset id or one of "
                               f"{', '.join(OFFLINE_NAMES)}.")
        if isinstance(self.path, os.PathLike):
            self.path = os.fspath(self.path)
        if not isinstance(self.split, str) or not self.split.strip():
            raise FastkitError(f"{where}: split must be a split name such as 'train', got {self.split!r}.")
        if self.columns is not None:
            self.columns = check_columns(self.columns, where)
        _check_number(self.weight, "weight", where, float)
        self.weight = None if self.weight is None else float(self.weight)
        _check_number(self.max_rows, "max_rows", where, int)

    @property
    def label(self) -> str:
        """The source's name in messages: ``name``, else the path (or the in-memory data's type)."""
        if self.name:
            return self.name
        return self.path if isinstance(self.path, str) else type(self.path).__name__

    @classmethod
    def parse(cls, text: str) -> DataSource:
        """A source from its CLI / YAML string: ``path`` or ``path?key=value&key=value``.

        Keys: ``columns=prompt:question,completion:answer``, ``weight=2``, ``max_rows=500``, ``split=train``,
        ``name=qa``. A path that exists as written (even with a ``?`` in it) is taken whole; Windows paths and
        Hub ids (``org/name``) keep their ``\\`` and ``/``.
        """
        if not isinstance(text, str) or not text.strip():
            raise FastkitError(f"data source {text!r}: give a path, a Hub dataset id or an offline name "
                               f"({', '.join(OFFLINE_NAMES)}), optionally with ?columns=...&weight=...")
        path, query = split_query(text)
        if query is None:
            return cls(path=text)
        return cls(path=path, **_query_options(query, text)) if query.strip() else cls(path=path)

    @classmethod
    def from_mapping(cls, entry: Mapping[str, Any]) -> DataSource:
        """A source from a YAML / dict entry: ``{path: qa.csv, columns: {prompt: question}, weight: 2}``."""
        if not isinstance(entry, Mapping):
            raise FastkitError(f"data source {entry!r:.80}: give a mapping such as {{path: qa.csv, weight: 2}} or "
                               "a path string.")
        accepted = [f.name for f in fields(cls)]
        unknown = [k for k in entry if k not in accepted]
        if unknown:
            rows = " (rows of data go in a file, or DataSource(path=[...rows]))" if unknown[0] in FIELDS else ""
            raise FastkitError(f"data source {entry.get('path', entry)!r:.80}: unknown key {unknown[0]!r}; the keys "
                               f"are {', '.join(accepted)}{rows}.")
        if "path" not in entry:
            raise FastkitError(f"data source {dict(entry)!r:.80}: no path; add path: (a file, a folder, a Hub "
                               "dataset id or an offline name).")
        return cls(**dict(entry))

    def to_mapping(self) -> dict[str, Any]:
        """The YAML form: ``path`` and every option that differs from its default (inverse of from_mapping)."""
        out: dict[str, Any] = {"path": self.path}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "path" and value != f.default:
                out[f.name] = dict(value) if isinstance(value, dict) else value
        return out

    def spec(self) -> str:
        """The CLI string form (inverse of :meth:`parse`): ``qa.csv?columns=prompt:question&weight=2``."""
        if not isinstance(self.path, str):
            raise FastkitError(f"data source {self.label!r}: in-memory data has no string form; save it to a file.")
        unwritable = next((c for c in [*(self.columns or {}).values(), self.split, self.name or ""]
                           if any(ch in c for ch in ",&:=?")), None)
        if unwritable is not None:  # parse() would split it: the string form cannot hold it
            raise FastkitError(f"data source {self.label!r}: {unwritable!r} holds one of , & : = ? and has no "
                               "string form (parse() would split it there); use the mapping form (to_mapping(), a "
                               "YAML data: entry).")
        parts = [f"{k}={_query_value(v)}" for k, v in self.to_mapping().items() if k != "path"]
        return self.path + ("?" + "&".join(parts) if parts else "")


MAX_WEIGHT = 10_000
"""The largest ``weight``: a row used more often than this is a typo (``1e300``), not a mix."""


def _check_number(value: Any, key: str, where: str, kind: type) -> None:
    if value is None:
        return
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int)
    if not ok or not math.isfinite(value) or value <= 0:
        what = ("a positive number (how often each row is used: 2 = twice)" if kind is float
                else "a positive whole number of rows")
        raise FastkitError(f"{where}: {key} must be {what}, got {value!r}.")
    if kind is float and value > MAX_WEIGHT:
        raise FastkitError(f"{where}: {key}={value:g} would use each row {value:g} times; the most is {MAX_WEIGHT:,} "
                           "(a mix's weights say how often each row is used: 2 = twice).")


def _query_value(value: Any) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}:{v}" for k, v in value.items())
    return format(value, "g") if isinstance(value, float) else str(value)


def _query_options(query: str, text: str) -> dict[str, Any]:
    """The options of a source string's ``key=value&...`` part, each converted; unknown keys refused."""
    options: dict[str, Any] = {}
    for item in query.split("&"):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if key not in QUERY_KEYS or not eq:
            raise FastkitError(f"data source {text!r}: {item!r} is not an option; give key=value with a key among "
                               f"{', '.join(QUERY_KEYS)} (e.g. qa.csv?columns=prompt:question,completion:answer"
                               "&weight=2).")
        if key in options:  # which one wins would be a guess: one rule, refuse
            raise FastkitError(f"data source {text!r}: {key} is given twice; give it once.")
        options[key] = _convert(key, value.strip(), text)
    return options


def _convert(key: str, value: str, text: str) -> Any:
    if key == "columns":
        pairs = [p.partition(":") for p in value.split(",") if p.strip()]
        if not pairs or any(not sep or not t.strip() or not c.strip() for t, sep, c in pairs):
            raise FastkitError(f"data source {text!r}: columns={value!r}; write field:column pairs separated by "
                               "commas, e.g. columns=prompt:question,completion:answer.")
        fields_named = [t.strip() for t, _, _ in pairs]
        twice = next((t for t in fields_named if fields_named.count(t) > 1), None)
        if twice:
            raise FastkitError(f"data source {text!r}: columns maps {twice!r} twice; map each field once.")
        return {t.strip(): c.strip() for t, _, c in pairs}
    if key in ("weight", "max_rows"):
        try:
            return float(value) if key == "weight" else int(value)
        except ValueError:
            raise FastkitError(f"data source {text!r}: {key}={value!r} is not a number.") from None
    return value


def split_query(text: str) -> tuple[str, str | None]:
    """``(path, query)`` of a source string ``path?key=value&...``; query None when the text is a path whole (no
    ``?``, or a file that exists as written with a ``?`` in its name)."""
    path, sep, query = text.rpartition("?")
    if not sep or os.path.exists(os.path.expanduser(text)):
        return text, None
    return path, query


def as_sources(sources: Any) -> list[DataSource]:
    """``sources`` (a string, a DataSource, a mapping, or a list of them) as a list of DataSources."""
    if isinstance(sources, (str, os.PathLike, DataSource, Mapping)):
        sources = [sources]
    if not isinstance(sources, Sequence) or not sources:
        raise FastkitError(f"data: give a source (a path string, a DataSource or a mapping with path:) or a list of "
                           f"them, got {sources!r:.80}.")
    out = []
    for item in sources:
        if isinstance(item, DataSource):
            out.append(item)
        elif isinstance(item, (str, os.PathLike)):
            out.append(DataSource.parse(os.fspath(item)))
        elif isinstance(item, Mapping):
            out.append(DataSource.from_mapping(item))
        else:
            raise FastkitError(f"data: {item!r:.80} is a {type(item).__name__}; give a path string, a DataSource "
                               "or a mapping with path:.")
    return out


def read_source(source: DataSource, drop_invalid: bool = False):
    """One source read, its columns mapped, its rows checked and normalized (errors name the source)."""
    where = f"data source {source.label!r}"
    path = source.path
    resolved = offline_source(path) if isinstance(path, str) else None
    try:
        from fastkit.data.read import as_dataset  # torch / datasets: only once a source is read

        dataset = as_dataset(path if resolved is None else resolved, source.split, where=where)
        if len(dataset) == 0:
            raise FastkitError(f"{where}: no rows; give at least one example.")
        if source.columns:
            dataset = map_columns(dataset, source.columns, where)
        dataset = normalize_dataset(check_rows(dataset, drop_invalid))
        return _with_system(dataset, source) if source.columns and "system" in source.columns else dataset
    except FastkitError as exc:
        text = str(exc)
        raise FastkitError(text if where in text else f"{where}: {text}") from exc


def _with_system(dataset, source: DataSource, have: list[str] | None = None):
    """A mapped ``system`` column as each chat's first turn (Alpaca rows already took it in; ``have``: a stream's
    columns)."""
    columns = dataset.column_names if have is None else have
    if "system" not in columns:
        return dataset
    if "text" in columns:
        raise FastkitError(f"data source {source.label!r}: 'system' is mapped, but the rows are plain text; a system "
                           "prompt needs chats (messages, or prompt + completion).")
    if "messages" in columns:
        return dataset.map(lambda r: {"messages": _system_first(r["system"], r["messages"])},
                           remove_columns=["system"])
    return dataset.map(lambda r: {"prompt": _system_first(r["system"], _as_turns(r["prompt"], "user")),
                                  "completion": _as_turns(r["completion"], "assistant")}, remove_columns=["system"])


def _system_first(system: Any, messages: list[dict]) -> list[dict]:
    if not system or (messages and messages[0].get("role") == "system"):
        return list(messages)
    return [{"role": "system", "content": system}, *messages]


def _as_turns(value: Any, role: str) -> list[dict]:
    return list(value) if isinstance(value, list) else [{"role": role, "content": value}]


KINDS = ("messages", "chat_prompt_completion", "prompt_completion", "text", "tokenized")
"""The common forms sources end in, from most to least general (a mix takes the first its sources allow)."""
KIND_COLUMNS = {"messages": ["messages"], "chat_prompt_completion": ["prompt", "completion"],
                "prompt_completion": ["prompt", "completion"], "text": ["text"]}


def kind_of(dataset) -> str:
    """Which of :data:`KINDS` a normalized dataset is."""
    columns = dataset.column_names
    if "input_ids" in columns:
        return "tokenized"
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion" if isinstance(dataset[0]["prompt"], str) else "chat_prompt_completion"
    return "text"


def _common_kind(kinds: list[tuple[str, str]]) -> str:
    """The form a mix of ``(source label, kind)`` ends in, or a FastkitError naming two sources that cannot mix."""
    chat = [(label, k) for label, k in kinds if k not in ("text", "tokenized")]
    for label, kind in kinds:
        other = next(((o, ok) for o, ok in kinds if ok != kind and (kind in ("text", "tokenized") or
                                                                  ok in ("text", "tokenized"))), None)
        if other:
            raise FastkitError(f"data sources {label!r} ({_KIND_WORDS[kind]}) and {other[0]!r} "
                               f"({_KIND_WORDS[other[1]]}) cannot be mixed into one dataset: plain text and "
                               "pre-tokenized rows mix only with their own kind. Map the columns of one of them "
                               "onto the other's form, or train them in separate runs.")
    return next(k for k in KINDS if any(kind == k for _, kind in chat or kinds))


_KIND_WORDS = {"messages": "chats", "chat_prompt_completion": "prompt/completion messages",
               "prompt_completion": "prompt/completion strings", "text": "plain text", "tokenized": "pre-tokenized"}


def to_kind(dataset, kind: str):
    """A normalized dataset in the common form ``kind`` (its columns only: what the trainer reads)."""
    own = kind_of(dataset)
    if kind == "tokenized":
        return dataset
    if own == kind:
        return dataset.select_columns(KIND_COLUMNS[kind])
    if kind == "messages":
        return dataset.map(lambda r: {"messages": _as_turns(r["prompt"], "user") + _as_turns(r["completion"],
                                                                                             "assistant")},
                           remove_columns=dataset.column_names)
    return dataset.map(lambda r: {"prompt": _as_turns(r["prompt"], "user"),
                                  "completion": _as_turns(r["completion"], "assistant")},
                       remove_columns=dataset.column_names)


def shares(counts: list[int], weights: list[float | None]) -> list[int]:
    """Rows each source contributes: ``round(n_i * w_i)`` (``n_i`` as it is without a weight): each source's weight
    repeats (or, below 1, samples) its own rows; no source loses rows to another's weight."""
    return [n if w is None else math.floor(n * float(w) + 0.5) for n, w in zip(counts, weights)]


def draw(n_rows: int, want: int, rng: random.Random) -> list[int]:
    """``want`` row indices of ``n_rows``: every row as many whole times as fit, plus a seeded sample (sorted)."""
    whole, rest = divmod(want, n_rows)
    return list(range(n_rows)) * whole + sorted(rng.sample(range(n_rows), rest))


def load_sources(sources: Any, *, seed: int = DEFAULT_SEED, drop_invalid: bool = False, streaming: bool = False,
                 mix: str = "concat"):
    """One ``datasets.Dataset`` from several sources: read, mapped, checked, normalized, then mixed (seeded).

    ``sources``: a string (:meth:`DataSource.parse`), a :class:`DataSource`, a mapping
    (:meth:`DataSource.from_mapping`), or a list of them. ``max_rows`` caps each source (a seeded sample) before
    the mix; a weight repeats (or samples) its source's rows as the module docstring says. One log line per
    source (rows read, rows used, rows repeated). The same sources and seed give the same rows in the same order.
    ``drop_invalid=True`` drops (and counts) untrainable rows instead of refusing them. ``streaming=True``: one
    ``IterableDataset`` of the sources streamed and interleaved (module docstring). ``mix``: one of :data:`MIXES`.
    """
    from datasets import concatenate_datasets

    from fastkit import _quiet

    _quiet.quiet_progress_bars()  # fastkit's log lines are the one progress display
    from fastkit.checks import check_choice

    check_choice("mix", mix, MIXES)
    listed = as_sources(sources)
    if streaming:
        return stream_sources(listed, seed, drop_invalid, mix)
    rng = random.Random(seed)
    read = [read_source(s, drop_invalid) for s in listed]
    capped = [_cap(ds, s, rng) for ds, s in zip(read, listed)]
    kind = _common_kind([(s.label, kind_of(ds)) for s, ds in zip(listed, capped)])
    if mix != "concat" and len(listed) > 1:
        return _interleave([to_kind(ds, kind) for ds in capped], listed, seed, mix, kind)
    wanted = shares([len(ds) for ds in capped], [s.weight for s in listed])
    parts = []
    for source, full, ds, want in zip(listed, read, capped, wanted):
        if want == 0:
            raise FastkitError(f"data source {source.label!r}: weight {source.weight:g} of its {len(ds)} rows "
                               "gives 0 rows; raise its weight or drop the source.")
        chosen = ds if want == len(ds) and source.weight is None else ds.select(draw(len(ds), want, rng))
        used = min(want, len(ds))
        logger.info("fastkit: data source %r: %d rows read, %d used, %d repeated (%d rows in the mix%s)",
                    source.label, len(full), used, want - used, want,
                    "" if source.weight is None else f", weight {source.weight:g}")
        parts.append(to_kind(chosen, kind))
    if len(parts) == 1:  # one source keeps its order; a sample or cap is written out (the fingerprint reads it)
        return parts[0] if len(parts[0]) == len(read[0]) and listed[0].weight is None else parts[0].flatten_indices()
    mixed = _concatenate(parts, listed, concatenate_datasets)
    logger.info("fastkit: data mix: %d rows from %d sources as %s, shuffled with seed %d", len(mixed), len(parts),
                _KIND_WORDS[kind], seed)
    return mixed.shuffle(seed=seed).flatten_indices()


def stream_source_of(source: DataSource, drop_invalid: bool = False):
    """One source as a stream: its columns mapped (a mapped ``system`` as each chat's first turn), its first
    ``max_rows`` rows when capped, its format found and its first rows checked (errors name the source)."""
    from fastkit.data.read import stream_source
    from fastkit.data.stream import check_first_rows, stream_columns

    where = f"data source {source.label!r}"
    path = source.path
    resolved = offline_source(path) if isinstance(path, str) else None
    try:
        dataset = stream_source(path if resolved is None else resolved, source.split, where=where)
        if source.columns:
            dataset = map_columns(dataset, source.columns, where, have=stream_columns(dataset, where))
            if "system" in source.columns:
                dataset = _with_system(dataset, source, have=stream_columns(dataset, where))
        if source.max_rows is not None:
            dataset = dataset.take(source.max_rows)
        check_first_rows(dataset, where, drop_invalid)
        return dataset
    except FastkitError as exc:
        text = str(exc)
        raise FastkitError(text if where in text else f"{where}: {text}") from exc


def stream_sources(listed: list[DataSource], seed: int = DEFAULT_SEED, drop_invalid: bool = False,
                   mix: str = "concat"):
    """The sources streamed and interleaved, each row drawn from a source with probability ∝ its weight."""
    from datasets import interleave_datasets

    from fastkit.data.formats import detect_format
    from fastkit.data.stream import stream_columns

    parts = [stream_source_of(s, drop_invalid) for s in listed]
    formats = [(s.label, detect_format(stream_columns(ds)) if "input_ids" not in stream_columns(ds) else "tokenized")
               for s, ds in zip(listed, parts)]
    for label, fmt in formats[1:]:
        if fmt != formats[0][1]:
            raise FastkitError(f"data sources {formats[0][0]!r} ({formats[0][1]}) and {label!r} ({fmt}) cannot be "
                               "streamed together: streamed sources share one format. Map one onto the other's "
                               "columns, or load them without --streaming (then they are converted and mixed).")
    weights = [1.0 if s.weight is None else s.weight for s in listed]
    for source, weight in zip(listed, weights):
        logger.info("fastkit: data source %r: streamed%s", source.label,
                    f", weight {weight:g} of {sum(weights):g}" if len(listed) > 1 else "")
    if len(parts) == 1:
        return parts[0]
    return interleave_datasets(parts, probabilities=_shares(listed), seed=seed,
                               stopping_strategy=STOPPING.get(mix, "all_exhausted"))


def _shares(listed: list[DataSource]) -> list[float]:
    """Each source's probability in an interleaved mix: its weight (1 when none) over the weights' sum."""
    weights = [1.0 if s.weight is None else float(s.weight) for s in listed]
    if not sum(weights) > 0:
        raise FastkitError("data: an interleaved mix draws rows by weight share; give at least one source a weight "
                           "above 0.")
    return [w / sum(weights) for w in weights]


def _interleave(parts: list, listed: list[DataSource], seed: int, mix: str, kind: str):
    """Tables interleaved by weight share (:data:`MIXES`), one log line per source and one for the mix."""
    from datasets import interleave_datasets

    probabilities = _shares(listed)
    for source, part, share in zip(listed, parts, probabilities):
        logger.info("fastkit: data source %r: %d rows read, drawn with probability %.3g", source.label, len(part),
                    share)
    try:
        mixed = interleave_datasets(parts, probabilities=probabilities, seed=seed, stopping_strategy=STOPPING[mix])
    except ValueError:  # features differ (e.g. a 'name' key in some messages): one table first, then split back
        mixed = interleave_datasets(_unified(parts, listed), probabilities=probabilities, seed=seed,
                                    stopping_strategy=STOPPING[mix])
    logger.info("fastkit: data mix (%s): %d rows from %d sources as %s, seed %d", mix, len(mixed), len(parts),
                _KIND_WORDS[kind], seed)
    return mixed.flatten_indices()


def _unified(parts: list, listed: list[DataSource]) -> list:
    """The parts with one set of features (rebuilt from their rows together), in the same order."""
    from fastkit.data.read import rows_to_dataset

    whole = rows_to_dataset([row for part in parts for row in part], where=" + ".join(repr(s.label) for s in listed))
    out, start = [], 0
    for part in parts:
        out.append(whole.select(range(start, start + len(part))))
        start += len(part)
    return out


def _cap(dataset, source: DataSource, rng: random.Random):
    if source.max_rows is None or len(dataset) <= source.max_rows:
        return dataset
    return dataset.select(sorted(rng.sample(range(len(dataset)), source.max_rows)))


def _concatenate(parts: list, listed: list[DataSource], concatenate_datasets):
    """The sources' rows in one table; nested fields that differ (a message key one source has) are unified."""
    try:
        return concatenate_datasets(parts)
    except ValueError:  # features differ (e.g. a 'name' key in some messages): rebuild from the rows
        from fastkit.data.read import rows_to_dataset

        rows = [row for part in parts for row in part]
        return rows_to_dataset(rows, where=" + ".join(repr(s.label) for s in listed))


__all__ = ["DEFAULT_SEED", "MIXES", "DataSource", "FIELDS", "QUERY_KEYS", "as_sources", "draw", "kind_of",
           "load_sources", "read_source", "shares", "stream_source_of", "stream_sources", "to_kind"]
