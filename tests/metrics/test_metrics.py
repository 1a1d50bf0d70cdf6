"""MetricsLogger sinks, the JSONL reader and the progress display."""

from __future__ import annotations

import io
import json
import math
import sys
import types

import pytest
from pydantic import ValidationError

from miles_engine.errors import ConfigError
from miles_engine.metrics import MetricsConfig, MetricsLogger, ProgressDisplay, read_metrics
from miles_engine.metrics import keys as K

QUIET = MetricsConfig(tensorboard=False, progress=False)


def test_jsonl_rows_flattened_flushed_and_nan_as_null(tmp_path):
    logger = MetricsLogger(tmp_path, QUIET)
    logger.log(1, {"reward": {"mean": 0.5, "two_turn": 1}, "loss": math.nan, "inf": math.inf, "ok": True})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # readable before close: flushed
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert row["step"] == 1 and row["kind"] == "train" and row["time"] >= 0
    assert row["reward/mean"] == 0.5 and row["reward/two_turn"] == 1
    assert row["loss"] is None and row["inf"] is None and row["ok"] == 1
    logger.log(2, {"sft/loss": 2.0}, kind="sft")
    logger.close()
    logger.close()  # idempotent
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["kind"]) for r in rows] == [(1, "train"), (2, "sft")]
    assert rows[1]["time"] >= rows[0]["time"]
    with pytest.raises(RuntimeError):
        logger.log(3, {})


def test_numpy_and_tensor_scalars_and_reserved_names(tmp_path):
    np = pytest.importorskip("numpy")
    with MetricsLogger(tmp_path, QUIET) as logger:
        logger.log(1, {"a": np.float32(0.25), "b": np.int64(3), "c": np.array(1.5)})
        with pytest.raises(ValueError, match="reserved"):
            logger.log(2, {"step": 1})
        with pytest.raises(TypeError, match="not a number"):
            logger.log(2, {"x": [1, 2]})
    assert read_metrics(tmp_path)[0] | {"time": 0} == {"step": 1, "time": 0, "kind": "train", "a": 0.25,
                                                         "b": 3, "c": 1.5}


def test_reader_tolerates_truncated_last_line_and_resume_appends(tmp_path):
    with MetricsLogger(tmp_path, QUIET) as logger:
        logger.log(1, {K.REWARD_MEAN: 0.1})
        logger.log(2, {K.REWARD_MEAN: 0.2})
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(path.read_bytes() + b'{"step": 3, "time": 9.0, "kind": "tr')  # crash mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert [r["step"] for r in read_metrics(path)] == [1, 2]  # the file itself also works
    with MetricsLogger(tmp_path, QUIET) as logger:  # --resume: appends after a repaired tail
        row = logger.log(3, {K.REWARD_MEAN: 0.3})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert row["time"] >= read_metrics(tmp_path)[1]["time"]  # the clock continues
    with pytest.raises(FileNotFoundError):
        read_metrics(tmp_path / "nope")


def test_config_is_strict():
    with pytest.raises(ValidationError):
        MetricsConfig(tensorbord=True)
    with pytest.raises(ValidationError):
        MetricsConfig(tensorboard="sometimes")
    assert MetricsConfig().tensorboard == "auto" and MetricsConfig(tensorboard=True).tensorboard is True


def _tensorboard_importable() -> bool:
    from miles_engine.metrics.sinks import _summary_writer

    return _summary_writer() is not None


@pytest.mark.skipif(not _tensorboard_importable(), reason="tensorboard is not installed")
def test_tensorboard_sink_writes_event_files(tmp_path):
    with MetricsLogger(tmp_path, MetricsConfig(tensorboard=True, progress=False)) as logger:
        assert logger.sinks == ["jsonl", "tensorboard"]
        for s in range(1, 4):
            logger.log(s, {K.REWARD_MEAN: 0.1 * s, "note": "text is skipped"})
        logger.log(1, {"loss": 1.0}, kind="sft")
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_tensorboard_auto_skips_and_true_fails_when_missing(tmp_path, monkeypatch, caplog):
    import miles_engine.metrics.sinks as sinks

    monkeypatch.setattr(sinks, "_summary_writer", lambda: None)
    with caplog.at_level("INFO"), MetricsLogger(tmp_path, MetricsConfig(progress=False)) as logger:
        assert logger.sinks == ["jsonl"]
    assert sum("TensorBoard not installed" in r.message for r in caplog.records) == 1
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        MetricsLogger(tmp_path, MetricsConfig(tensorboard=True, progress=False))


def test_wandb_sink_is_offline_under_run_dir(tmp_path, monkeypatch):
    calls: dict = {"log": [], "define": []}

    class FakeRun:
        def define_metric(self, name, step_metric=None):
            calls["define"].append((name, step_metric))

        def log(self, data):
            calls["log"].append(data)

        def finish(self):
            calls["finished"] = True

    def init(**kw):
        calls["init"] = kw
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = MetricsConfig(tensorboard=False, wandb=True, wandb_project="p", progress=False)
    with MetricsLogger(tmp_path, cfg, run_config={"lr": 1e-4}) as logger:
        logger.log(1, {K.REWARD_MEAN: 0.5})
        logger.log(1, {"loss": 2.0, "sft/acc": 0.5}, kind="sft")
    assert calls["init"]["mode"] == "offline" and calls["init"]["dir"] == str(tmp_path)
    assert calls["init"]["project"] == "p" and calls["init"]["config"] == {"lr": 1e-4}
    assert calls["log"] == [{"train_step": 1, "reward/mean": 0.5}, {"sft_step": 1, "sft/loss": 2.0, "sft/acc": 0.5}]
    assert ("sft/loss", "sft_step") in calls["define"] and calls["finished"]


def test_wandb_enabled_but_missing_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(ConfigError, match="pip install wandb"):
        MetricsLogger(tmp_path, MetricsConfig(tensorboard=False, wandb=True, progress=False))


def test_failing_optional_sink_is_disabled_not_fatal(tmp_path, caplog):
    with MetricsLogger(tmp_path, QUIET) as logger:
        class Broken:
            def write(self, *a):
                raise OSError("disk gone")

            def close(self):
                pass
        logger._optional.append(Broken())
        logger.log(1, {"a": 1.0})
        logger.log(2, {"a": 2.0})
    assert len(read_metrics(tmp_path)) == 2 and "disabled" in caplog.text


def test_progress_plain_lines_when_not_a_tty(tmp_path):
    out = io.StringIO()  # not a TTY
    cfg = MetricsConfig(tensorboard=False, progress_every=5)
    with MetricsLogger(tmp_path, cfg, total_steps=12, progress_stream=out) as logger:
        assert logger.progress.plain
        for s in range(1, 13):
            logger.log(s, {K.REWARD_MEAN: 0.1 * s, K.TIME_STEP: 0.5, K.QUEUE_SIZE: 3, K.STALENESS_AVG: 0.25,
                           K.NUM_SAMPLES: 8})
        logger.log(12, {K.EVAL_REWARD: 1.0}, kind="eval")  # other kinds do not move the bar
    lines = out.getvalue().splitlines()
    assert [ln.split(" | ")[0] for ln in lines] == ["[train] step 1/12 (8%)", "[train] step 5/12 (42%)",
                                                    "[train] step 10/12 (83%)", "[train] step 12/12 (100%)"]
    last = lines[-1]
    assert "reward 1.100" in last  # 3-step moving average of 1.0, 1.1, 1.2
    assert "step 0.50s" in last and "queue 3" in last and "stale 0.25" in last and "samples/s" in last


def test_progress_phases_and_rich_mode():
    out = io.StringIO()
    p = ProgressDisplay(3, kind="sft", plain=True, stream=out)
    p.update(1, "sft", {K.SFT_LOSS: 2.5})
    p.update(1, "train", {K.REWARD_MEAN: 1.0})  # ignored during the sft phase
    p.set_total(2, kind="train")
    p.update(1, "train", {K.REWARD_MEAN: 1.0})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[sft] step 1/3") and lines[1].startswith("[train] step 1/2")
    assert "loss 2.5000" in lines[0] and "reward 1.000" in lines[1]
    rich_out = io.StringIO()
    bar = ProgressDisplay(4, plain=False, stream=rich_out)
    bar.update(2, "train", {K.REWARD_MEAN: 0.5, K.SAMPLES_PER_S: 12.0})
    bar.close()
    assert "reward 0.500" in rich_out.getvalue() and "samples/s 12.0" in rich_out.getvalue()
