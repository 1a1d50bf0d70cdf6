"""``sft.dataset``: chat transcripts from a data file → validated token rows, split into train and
held-out eval rows, and the step schedule (shuffled per epoch, optionally packed by tokens).

Every row is read, validated and rendered before the first step, so bad data stops the run
with one line naming the file, the row and the field (or, with ``skip_bad_rows``, is counted
and reported) and never mid-epoch.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, model_validator

from miles_engine.components import Section
from miles_engine.data.errors import BadRows, DataError
from miles_engine.data.files import DataFileOptions, open_rows
from miles_engine.data.splits import SplitOptions, check_disjoint, in_eval
from miles_engine.data.transcripts import Transcript, TranscriptFields, parse_transcript, transcript_row
from miles_engine.environments.capabilities import demonstrations
from miles_engine.tito.messages import normalize_messages, normalize_tools


class ExportDemos(Section):
    """Write ``path`` first from the recipe environment's demonstrations (e.g. the shell drills)."""

    n: int = Field(2000, ge=1, description="demonstrations exported")
    seed: int = 0
    wrong_fraction: float | None = Field(None, ge=0, le=1, description="default: the environment's own setting")


class SFTDatasetConfig(DataFileOptions):
    """Transcripts to train on (OpenAI messages with tool calls); rendered through the policy's chat family."""

    fields: TranscriptFields = Field(default_factory=TranscriptFields)
    eval_fraction: float = Field(0.0, ge=0, lt=1, description="share of transcripts (by id hash) held out for the "
                                 "eval loss")
    eval_split: str | None = Field(None, description="the source's own held-out split instead of eval_fraction")
    split_seed: int = Field(0, description="salt of the id hash of the split")
    skip_bad_rows: bool = Field(False, description="skip (count and report) rows that cannot be used instead of "
                                "stopping with the first one's error")
    max_tokens: int | None = Field(None, ge=2, description="a rendered transcript longer than this is a bad row")
    pack_tokens: int | None = Field(None, ge=2, description="pack steps by tokens: each step takes shuffled rows "
                                    "while their total stays within this budget (instead of sft.batch_size rows)")
    eval_every: int = Field(0, ge=0, description="SFT steps between eval-loss passes (0: only after the last)")
    export_demos: ExportDemos | None = Field(None, description="(re)write `path` at start-up as JSONL "
                                             "transcripts of the environment's demonstrations")
    checkpoint_every: int = Field(0, ge=0, description="SFT steps between SFT checkpoints (0: only when stopped "
                                  "early; the end of SFT is RL step 0's checkpoint)")

    @model_validator(mode="after")
    def _one_split_kind(self) -> SFTDatasetConfig:
        if self.eval_split is not None and self.eval_fraction:
            raise ValueError("set either sft.dataset.eval_split or sft.dataset.eval_fraction, not both")
        return self


@dataclass
class SFTData:
    train: list[tuple[list[int], list[int]]]
    eval: list[tuple[list[int], list[int]]]
    bad: BadRows
    digest: str  # of the token rows: a resumed run must see the same data
    transcripts: list[Transcript] = field(default_factory=list)


def read_transcripts(cfg: SFTDatasetConfig, split: str | None = None, bad: BadRows | None = None) -> list[Transcript]:
    label = str(cfg.resolved)
    out: list[Transcript] = []
    for number, row in open_rows(cfg, split):
        try:
            out.append(parse_transcript(row, cfg.fields, label, number))
        except DataError as exc:
            if not cfg.skip_bad_rows or bad is None:
                raise
            bad.add(exc)
    return out


def split_transcripts(cfg: SFTDatasetConfig, bad: BadRows) -> tuple[list[Transcript], list[Transcript]]:
    label = str(cfg.resolved)
    rows = read_transcripts(cfg, bad=bad)
    if cfg.eval_split is not None:
        held = read_transcripts(cfg, cfg.eval_split, bad)
        check_disjoint([t.id for t in rows], [t.id for t in held], label)
        return rows, held
    opts = SplitOptions(eval_fraction=cfg.eval_fraction, seed=cfg.split_seed)
    train = [t for t in rows if not in_eval(t.id, opts)]
    held = [t for t in rows if in_eval(t.id, opts)]
    return train, held


def render_rows(codec: Any, cfg: SFTDatasetConfig, transcripts: list[Transcript],
                bad: BadRows) -> list[tuple[list[int], list[int]]]:
    label = str(cfg.resolved)
    rows = []
    for t in transcripts:
        try:
            ids, mask = transcript_row(codec, t, label, cfg.fields.messages)
            if cfg.max_tokens is not None and len(ids) > cfg.max_tokens:
                raise DataError(label, f"renders to {len(ids)} tokens, more than sft.dataset.max_tokens="
                                f"{cfg.max_tokens}", row=t.row, field=cfg.fields.messages)
        except DataError as exc:
            if not cfg.skip_bad_rows:
                raise
            bad.add(exc)
            continue
        rows.append((ids, mask))
    return rows


def load_sft_data(codec: Any, cfg: SFTDatasetConfig) -> SFTData:
    label = str(cfg.resolved)
    bad = BadRows(label)
    train_t, eval_t = split_transcripts(cfg, bad)
    train, held = render_rows(codec, cfg, train_t, bad), render_rows(codec, cfg, eval_t, bad)
    if not train:
        raise DataError(label, "has no usable training transcript" + (f" ({bad.summary()})" if bad.count else ""))
    h = hashlib.sha256()
    for part in (train, held):
        h.update(repr(part).encode())
    return SFTData(train, held, bad, h.hexdigest(), train_t)


def export_demonstrations(cfg: SFTDatasetConfig, source: Any) -> None:
    """``export_demos``: JSONL rows ``{task_id, messages, tools}``, written atomically, unchanged
    when the file already holds exactly them."""
    if cfg.export_demos is None:
        return
    import json
    import os

    e = cfg.export_demos
    lines = [json.dumps({"task_id": f"{d.task.id}", "messages": d.conversation(), "tools": d.tools}, sort_keys=True)
             for d in demonstrations(source, e.n, seed=e.seed, wrong_fraction=e.wrong_fraction)]
    text = "".join(line + "\n" for line in lines)
    path = cfg.resolved
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def corpus_texts(cfg: SFTDatasetConfig, codec: Any, limit: int, source: Any = None) -> list[str]:
    """Rendered training transcripts (the policy tokenizer's corpus when it is trained at start-up)."""
    if source is not None:
        export_demonstrations(cfg, source)

    bad = BadRows(str(cfg.resolved))
    texts = []
    for t in split_transcripts(cfg, bad)[0][:limit]:
        texts.append(codec.render(normalize_messages([*t.prompt, *t.turns]), normalize_tools(t.tools),
                                  add_generation_prompt=False))
    return texts


def schedule(rows: list[tuple[list[int], list[int]]], *, epochs: float, batch_size: int,
             pack_tokens: int | None, seed: int) -> list[list[int]]:
    """Every step's row indices, fixed by the seed: epoch ``e`` shuffles with ``Random(seed, e)``.

    ``pack_tokens``: a step takes rows in that order while their token total stays within the
    budget (a longer row goes alone). Fractional epochs end the last epoch early."""
    full = math.ceil(epochs)
    steps: list[list[int]] = []
    per_epoch = 0
    for epoch in range(full):
        order = list(range(len(rows)))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        batches: list[list[int]] = []
        if pack_tokens is None:
            batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        else:
            current: list[int] = []
            used = 0
            for i in order:
                n = len(rows[i][0])
                if current and used + n > pack_tokens:
                    batches.append(current)
                    current, used = [], 0
                current.append(i)
                used += n
            if current:
                batches.append(current)
        per_epoch = per_epoch or len(batches)
        steps += batches
    return steps[:max(1, math.ceil(per_epoch * epochs))]
