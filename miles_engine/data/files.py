"""Open a local data source with Hugging Face ``datasets`` (imported here, lazily) and iterate
its rows as plain dicts, numbered from 1.

Sources: a ``.jsonl``/``.json``, ``.parquet``, ``.arrow`` or ``.csv`` file, a directory written by
``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or a local dataset repository (data
files plus an optional README ``configs:`` block, loaded with ``load_dataset(dir)``). Nothing is
fetched: ``HF_DATASETS_OFFLINE=1`` is set before ``datasets`` is imported.

Arrow gives every row of a column the union of the keys seen in that column (absent keys read
as ``None``), so ``None`` values are dropped from nested objects: a message without
``tool_calls`` reads back as it was written.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from miles_engine.components import Section
from miles_engine.data.errors import DataError

Format = Literal["auto", "json", "parquet", "arrow", "csv", "disk", "repo"]
_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


class DataFileOptions(Section):
    path: str = Field(description="a .jsonl/.json/.parquet/.arrow/.csv file, a save_to_disk directory or a local "
                      "dataset repository directory (~ and $VARS are expanded)")
    format: Format = Field("auto", description="auto: from the suffix / the directory's contents")
    split: str = Field("train", description="the split read (save_to_disk DatasetDicts and repositories)")
    streaming: bool = Field(False, description="iterate rows without building the Arrow cache "
                            "(datasets' IterableDataset)")
    cache_dir: str | None = Field(None, description="datasets' cache for converted files (default: its own)")

    @property
    def resolved(self) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(self.path)))


def detect_format(path: Path) -> str:
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return "disk"
        return "repo"
    if path.suffix == ".py":
        raise DataError(str(path), "a dataset loading script: datasets >= 4 no longer runs loading scripts; "
                        "export the rows (Dataset.save_to_disk, to_parquet or to_json) and point `path` at them")
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise DataError(str(path), f"cannot tell the format from the suffix '{path.suffix}'; set format to one of "
                        f"json, parquet, arrow, csv, disk, repo")
    return fmt


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError as exc:
        raise DataError("datasets", "the Hugging Face `datasets` library is not installed: "
                        "pip install 'miles-engine[data]' (or datasets)") from exc
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    return datasets


def open_dataset(options: DataFileOptions, split: str | None = None) -> Any:
    """A ``datasets.Dataset`` (or ``IterableDataset`` when streaming) of one split."""
    path = options.resolved
    label = str(path)
    split = split or options.split
    if not path.exists():
        raise DataError(label, "no such file or directory")
    fmt = detect_format(path) if options.format == "auto" else options.format
    ds = _datasets()
    try:
        if fmt == "disk":
            loaded = ds.load_from_disk(str(path))
            if isinstance(loaded, ds.DatasetDict):
                if split not in loaded:
                    raise DataError(label, f"has no split '{split}' (splits: {', '.join(loaded)})", field="split")
                loaded = loaded[split]
            return loaded.to_iterable_dataset() if options.streaming else loaded
        kwargs: dict[str, Any] = {"split": split, "streaming": options.streaming}
        if options.cache_dir:
            kwargs["cache_dir"] = options.cache_dir
        if fmt == "repo":
            return ds.load_dataset(str(path), **kwargs)
        if split != "train":
            raise DataError(label, f"a single {fmt} file has only the split 'train', not '{split}'", field="split")
        return ds.load_dataset(fmt, data_files=str(path), **kwargs)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow / datasets raise many types; one line names the file
        text = " ".join(str(exc).split())[:300]
        if "Unknown split" in text or "split" in text.lower() and fmt == "repo":
            raise DataError(label, f"cannot open split '{split}': {text}", field="split") from None
        raise DataError(label, f"cannot be read as {fmt}: {type(exc).__name__}: {text}") from None


def drop_nones(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: drop_nones(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nones(v) for v in value]
    return value


def open_rows(options: DataFileOptions, split: str | None = None) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row number from 1, row)`` of one split; a read error mid-file names the row it stopped at."""
    dataset = open_dataset(options, split)
    label = str(options.resolved)
    it = iter(dataset)
    number = 0
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001 - a malformed line in a streamed file
            raise DataError(label, f"cannot be read: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                            row=number + 1) from None
        number += 1
        yield number, drop_nones(dict(row))


def column_names(options: DataFileOptions, split: str | None = None) -> list[str] | None:
    names = getattr(open_dataset(options, split), "column_names", None)
    return list(names) if names is not None else None
