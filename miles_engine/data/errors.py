"""One error per bad row, naming the file, the row (1-based) and the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from miles_engine.errors import MilesError


class DataError(MilesError):
    """A data file, or one of its rows, cannot be used."""

    def __init__(self, file: str, why: str, *, row: int | None = None, field: str | None = None) -> None:
        self.file, self.row, self.field, self.why = file, row, field, why
        where = file + (f": row {row}" if row is not None else "") + (f": field '{field}'" if field else "")
        super().__init__(f"{where}: {why}")


@dataclass
class BadRows:
    """Rows skipped under ``skip_bad_rows``: counted, the first few kept for the report."""

    file: str
    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, error: DataError) -> None:
        self.count += 1
        if len(self.examples) < 5:
            self.examples.append(str(error))

    def summary(self) -> str:
        if not self.count:
            return f"{self.file}: no bad rows"
        return (f"{self.file}: skipped {self.count} bad row(s) (skip_bad_rows); first: "
                + " | ".join(self.examples))
