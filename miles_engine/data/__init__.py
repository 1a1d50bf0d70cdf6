"""Rows from local data files (JSONL / Parquet / Arrow / ``save_to_disk`` directories / local
``datasets`` repositories) through Hugging Face ``datasets``, imported lazily: typed reading,
one-line bad-row errors, deterministic splits, and chat transcripts for SFT."""

from miles_engine.data.errors import BadRows, DataError
from miles_engine.data.files import DataFileOptions, open_rows
from miles_engine.data.splits import SplitOptions, check_disjoint, hash_fraction

__all__ = ["BadRows", "DataError", "DataFileOptions", "SplitOptions", "check_disjoint", "hash_fraction", "open_rows"]
