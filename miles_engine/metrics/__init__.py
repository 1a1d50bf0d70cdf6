"""Run metrics: JSONL (always), TensorBoard and W&B offline (optional), a progress bar.

Key names live in :mod:`miles_engine.metrics.keys`; ``miles report`` reads the JSONL.
"""

from miles_engine.metrics.jsonl import METRICS_FILE, read_metrics
from miles_engine.metrics.logger import MetricsConfig, MetricsLogger
from miles_engine.metrics.progress import ProgressDisplay

__all__ = ["METRICS_FILE", "MetricsConfig", "MetricsLogger", "ProgressDisplay", "read_metrics"]
