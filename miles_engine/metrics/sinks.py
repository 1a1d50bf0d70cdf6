"""Optional metric sinks: TensorBoard (when importable) and W&B in offline mode."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from miles_engine.errors import ConfigError
from miles_engine.metrics.jsonl import Value

log = logging.getLogger(__name__)


def numeric(kind: str, metrics: Mapping[str, Value]) -> dict[str, float]:
    """Numeric values only, tagged ``<kind>/<key>`` unless kind is ``train`` or the key
    already starts with ``<kind>/`` (``sft/loss`` stays ``sft/loss``)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            tag = key if kind == "train" or key.startswith(f"{kind}/") else f"{kind}/{key}"
            out[tag] = float(value)
    return out


def _summary_writer() -> Any:
    """``SummaryWriter`` class from torch (needs the tensorboard package) or tensorboardX, or
    ``None``; checks that a package is installed before importing torch for it."""
    if importlib.util.find_spec("tensorboard") is not None:
        try:
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter
        except ImportError:
            pass
    if importlib.util.find_spec("tensorboardX") is not None:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    return None


class TensorBoardSink:
    """Scalars to ``RUN_DIR/tensorboard`` (event files), one tag per metric key."""

    def __init__(self, run_dir: Path, writer_cls: Any) -> None:
        self.dir = Path(run_dir) / "tensorboard"
        self._writer = writer_cls(log_dir=str(self.dir))

    def write(self, step: int, kind: str, metrics: Mapping[str, Value]) -> None:
        for tag, value in numeric(kind, metrics).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """``wandb.init(mode="offline", dir=RUN_DIR)``; never goes online. ``wandb sync`` uploads later."""

    def __init__(self, run_dir: Path, project: str, run_config: Mapping[str, Any] | None) -> None:
        import wandb

        self._wandb = wandb
        self._run = wandb.init(project=project, dir=str(run_dir), mode="offline", name=Path(run_dir).name,
                               config=dict(run_config or {}))
        self._tags: set[str] = set()

    def write(self, step: int, kind: str, metrics: Mapping[str, Value]) -> None:
        values = numeric(kind, metrics)
        axis = f"{kind}_step"  # one step axis per row kind: sft, train and eval steps overlap
        for tag in values.keys() - self._tags:
            self._run.define_metric(tag, step_metric=axis)
            self._tags.add(tag)
        self._run.log({axis: step, **values})

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


def make_tensorboard(run_dir: Path, setting: bool | str) -> TensorBoardSink | None:
    if setting is False:
        return None
    writer_cls = _summary_writer()
    if writer_cls is None:
        if setting is True:
            raise ConfigError("metrics.tensorboard is true but neither torch.utils.tensorboard nor tensorboardX "
                              "can be imported; pip install tensorboard, or set metrics.tensorboard: auto")
        log.info("TensorBoard not installed; metrics go to metrics.jsonl only (pip install tensorboard)")
        return None
    return TensorBoardSink(run_dir, writer_cls)


def make_wandb(run_dir: Path, enabled: bool, project: str, run_config: Mapping[str, Any] | None) -> WandbSink | None:
    if not enabled:
        return None
    try:
        import wandb  # noqa: F401
    except ImportError as exc:
        raise ConfigError("metrics.wandb is true but wandb is not installed; pip install wandb, "
                          "or set metrics.wandb: false") from exc
    return WandbSink(run_dir, project, run_config)
