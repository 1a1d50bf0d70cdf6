"""The dataset environment: same tasks from every file format, disjoint stable splits, an exact
resumed data cursor, sandboxed rows, and one-line errors for bad rows."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles_engine.data.errors import DataError
from miles_engine.environments.protocol import EpisodeContext
from miles_engine.rollout.tasks import TaskStream
from miles_engine.testing.environment import EnvironmentContract
from miles_env_dataset.generators import arithmetic_rows
from miles_env_dataset.options import DatasetEnvOptions, GenerateOptions
from miles_env_dataset.source import DatasetSource

FIELDS = {"prompt": "prompt", "answer": "answer", "task_id": "task_id", "metadata": ["op"]}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def source(path, tmp_path, **kw) -> DatasetSource:
    return DatasetSource(DatasetEnvOptions(path=str(path), fields=kw.pop("fields", FIELDS),
                                           cache_dir=str(tmp_path / "cache"), **kw))


def described(src: DatasetSource) -> list:
    return [(t.id, t.prompt(), t.metadata["answer"], t.metadata["op"])
            for t in (src.load_task(r.id) for r in src.list_tasks())]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("data")
    rows = arithmetic_rows(GenerateOptions(rows=60, seed=4))
    jsonl = write_jsonl(root / "rows.jsonl", rows)
    ds = datasets.load_dataset("json", data_files=jsonl, split="train", cache_dir=str(root / "cache"))
    ds.to_parquet(str(root / "rows.parquet"))
    ds.save_to_disk(str(root / "disk"))
    datasets.DatasetDict({"train": ds.select(range(50)), "test": ds.select(range(50, 60))}).save_to_disk(
        str(root / "dict"))
    return root, rows


def test_jsonl_parquet_and_save_to_disk_give_the_same_tasks(files, tmp_path):
    root, rows = files
    got = [described(source(root / name, tmp_path)) for name in ("rows.jsonl", "rows.parquet", "disk")]
    assert got[0] == got[1] == got[2]
    assert len(got[0]) == 60 and got[0][0][2] == rows[0]["answer"]
    streamed = described(source(root / "rows.parquet", tmp_path, streaming=True))
    assert streamed == got[0]


def test_seeded_shuffle_is_a_stable_permutation_also_when_streaming(files, tmp_path):
    root, rows = files
    ids = lambda src: [r.id for r in src.list_tasks()]  # noqa: E731
    in_order = [r["task_id"] for r in rows]
    shuffled = ids(source(root / "rows.jsonl", tmp_path, shuffle_seed=3))
    assert sorted(shuffled) == sorted(in_order) and shuffled != in_order
    assert ids(source(root / "rows.parquet", tmp_path, shuffle_seed=3, streaming=True)) == shuffled
    assert ids(source(root / "rows.jsonl", tmp_path, shuffle_seed=4)) != shuffled
    assert ids(source(root / "rows.jsonl", tmp_path, shuffle_seed=3, limit=7)) == shuffled[:7]


def test_hash_split_is_disjoint_complete_and_stable(files, tmp_path):
    root, rows = files
    split = {"eval_fraction": 0.25, "seed": 7}
    train = {r.id for r in source(root / "rows.jsonl", tmp_path, split_by={**split, "use": "train"}).list_tasks()}
    held = {r.id for r in source(root / "rows.jsonl", tmp_path, split_by={**split, "use": "eval"}).list_tasks()}
    assert train.isdisjoint(held) and len(train | held) == 60 and 5 <= len(held) <= 25
    shuffled = write_jsonl(tmp_path / "reordered.jsonl", list(reversed(rows)) + [
        {"task_id": "new-row", "prompt": "p", "answer": 1, "op": "add"}])
    held_again = {r.id for r in source(shuffled, tmp_path, split_by={**split, "use": "eval"}).list_tasks()}
    assert held_again - {"new-row"} == held  # by id: row order and other rows do not move it
    other = {r.id for r in source(root / "rows.jsonl", tmp_path, split_by={**split, "seed": 8, "use": "eval"})
             .list_tasks()}
    assert other != held


def test_the_sources_own_splits_must_be_disjoint(files, tmp_path):
    root, rows = files
    held = {r.id for r in source(root / "dict", tmp_path, split_by={"eval_split": "test", "use": "eval"}).list_tasks()}
    assert held == {r["task_id"] for r in rows[50:]}
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    write_jsonl(repo / "data" / "train.jsonl", rows[:40])
    write_jsonl(repo / "data" / "test.jsonl", rows[35:45])
    with pytest.raises(DataError, match=r"5 task id\(s\) are in both the train and the eval split"):
        source(repo, tmp_path, split_by={"eval_split": "test"})


def test_resumed_cursor_continues_the_task_order_exactly(files, tmp_path):
    root, _ = files
    stream = TaskStream(source(root / "rows.jsonl", tmp_path, shuffle_seed=3), seed=11)
    whole = [ref.id for _, ref in zip(range(150), stream.iter_from(0))]
    again = TaskStream(source(root / "disk", tmp_path, shuffle_seed=3), seed=11)  # a restarted process
    resumed = [ref.id for _, ref in zip(range(150 - 77), again.iter_from(77))]
    assert resumed == whole[77:] and again.at(77).id == whole[77]


def test_bad_rows_one_line_each_or_counted(tmp_path):
    rows = arithmetic_rows(GenerateOptions(rows=6))
    del rows[3]["answer"]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as info:
        source(path, tmp_path)
    assert str(info.value) == f"{path}: row 4: field 'answer': is missing"
    src = source(path, tmp_path, skip_bad_rows=True)
    assert len(src.specs) == 5 and src.bad_rows.count == 1
    rows[3]["answer"] = 1
    rows[5]["task_id"] = rows[1]["task_id"]
    dup = write_jsonl(tmp_path / "dup.jsonl", rows)
    with pytest.raises(DataError, match=r"dup.jsonl: row 6: field 'task_id': task id .* is also row 2's"):
        source(dup, tmp_path)
    with pytest.raises(DataError, match=r"loading script"):
        source(tmp_path / "x.py", tmp_path) if (tmp_path / "x.py").write_text("") is not None else None


def test_generated_file_is_rewritten_only_when_different(tmp_path):
    path = tmp_path / "gen" / "a.jsonl"
    src = source(path, tmp_path, generate={"rows": 30, "seed": 1})
    assert len(src.specs) == 30 and path.is_file()
    mtime = path.stat().st_mtime_ns
    source(path, tmp_path, generate={"rows": 30, "seed": 1})
    assert path.stat().st_mtime_ns == mtime


def test_a_row_with_tests_is_a_sandboxed_task_scored_by_its_command(tmp_path):
    from miles_engine.hub import Hub

    rows = [{"task_id": "ok", "prompt": "make /app/x hold hi", "check": "grep -qx hi /app/x"},
            {"task_id": "bad", "prompt": "p", "check": "false"}]
    src = source(write_jsonl(tmp_path / "sb.jsonl", rows), tmp_path,
                 fields={"prompt": "prompt", "answer": None, "task_id": "task_id", "test_command": "check"},
                 max_turns=4)
    caps = src.capabilities()
    assert caps.needs_sandbox and caps.tools == ("bash",)
    backend = Hub().create("sandbox", "local", {})

    async def run(task_id: str) -> float:
        task = src.load_task(task_id)
        sandbox = await backend.create(task.sandbox_spec())
        try:
            ctx = EpisodeContext(task=task, sandbox=sandbox)
            await task.setup(ctx)
            await ctx.call_tool("bash", {"command": "echo hi > /app/x"})
            return (await task.verify(ctx)).reward
        finally:
            await sandbox.close()
            await backend.aclose()

    assert asyncio.run(run("ok")) == 1.0
    assert asyncio.run(run("bad")) == 0.0


class TestDatasetContract(EnvironmentContract):
    @pytest.fixture
    def source(self, tmp_path):
        return DatasetSource(DatasetEnvOptions(path=str(tmp_path / "g.jsonl"), generate={"rows": 20},
                                               fields=FIELDS, cache_dir=str(tmp_path / "cache")))


def test_cli_path_takes_the_data_file(tmp_path):
    """``--path`` names what the environment reads: here a file (not only a directory)."""
    from click.testing import CliRunner

    from miles_engine.cli.main import cli

    rows = write_jsonl(tmp_path / "rows.jsonl", arithmetic_rows(GenerateOptions(rows=5, seed=1)))
    result = CliRunner().invoke(cli, ["env", "tasks", "dataset", "--path", rows, "-o", f"cache_dir={tmp_path / 'c'}",
                                      "--json"], catch_exceptions=False)
    listed = json.loads(result.stdout)
    assert result.exit_code == 0 and len(listed) == 5 and {r["status"] for r in listed} == {"ok"}
