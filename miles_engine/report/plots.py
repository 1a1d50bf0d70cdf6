"""The report's figures (matplotlib, Agg canvas, no pyplot state). Each figure is drawn only
when the run has at least one of its keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_engine.metrics import keys as K
from miles_engine.report.data import MA_WINDOW, ReportError, RunData, moving_average

Figure = Any
Draw = Callable[[RunData, Figure], bool]


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ReportError("miles report needs matplotlib, which is not installed: pip install matplotlib "
                          "(or pip install 'miles-engine[report]')") from exc


def _style(ax: Any, legend: str = "best") -> None:
    from matplotlib.ticker import MaxNLocator

    ax.grid(alpha=0.3)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.legend(loc=legend, fontsize="small")


def _lines(ax: Any, data: RunData, items: list[tuple[str, str]], kind: str | None = "train", **kw: Any) -> bool:
    drawn = False
    for key, label in items:
        steps, values = data.series(key, kind)
        if steps:
            ax.plot(steps, values, label=label, marker="." if len(steps) < 40 else None, **kw)
            drawn = True
    if drawn:
        _style(ax)
    return drawn


def draw_reward(data: RunData, fig: Figure) -> bool:
    steps, values = data.series(K.REWARD_MEAN)
    kinds = [k for k in data.reward_kinds() if data.has(K.REWARD_PREFIX + k)]
    if not steps and not kinds:
        return False
    axes = fig.subplots(1, 2 if (steps and kinds) else 1, squeeze=False)[0]
    if steps:
        ax = axes[0]
        ax.plot(steps, values, alpha=0.35, label="reward (per step)")
        ax.plot(*moving_average(steps, values), linewidth=2.2, label=f"{MA_WINDOW}-step moving avg")
        ax.set_title("reward")
        _style(ax)
    if kinds:
        ax = axes[-1]
        for kind in kinds:
            ax.plot(*moving_average(*data.series(K.REWARD_PREFIX + kind)), label=kind)
        ax.set_title(f"reward by task kind ({MA_WINDOW}-step moving avg)")
        _style(ax)
    return True


def _single(title: str, items: list[tuple[str, str]], kind: str | None = "train",
            ylim: tuple[float, float] | None = None) -> Draw:
    def draw(data: RunData, fig: Figure) -> bool:
        if not any(data.has(key, kind) for key, _ in items):
            return False
        ax = fig.subplots()
        _lines(ax, data, items, kind)
        ax.set_title(title)
        if ylim:
            ax.set_ylim(*ylim)
        return True
    return draw


def draw_tis(data: RunData, fig: Figure) -> bool:
    ratio = [(K.TIS_RATIO_MEAN, "ratio mean"), (K.TIS_RATIO_MIN, "ratio min"), (K.TIS_RATIO_MAX, "ratio max")]
    other = [(K.TIS_CLIPPED_FRAC, "clipped fraction"), (K.TIS_ABS_RATIO_MINUS_1, "mean |ratio - 1|"),
             (K.TIS_LOGPROB_DIFF, "mean |logp train - logp rollout|")]
    has_ratio, has_other = (any(data.has(k) for k, _ in group) for group in (ratio, other))
    if not (has_ratio or has_other):
        return False
    axes = list(fig.subplots(1, int(has_ratio) + int(has_other), squeeze=False)[0])
    if has_ratio:
        ax = axes.pop(0)
        _lines(ax, data, ratio)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title("train / rollout probability ratio (pre-clip)")
    if has_other:
        ax = axes.pop(0)
        _lines(ax, data, other)
        ax.set_title("mismatch correction")
    return True


def draw_step_time(data: RunData, fig: Figure) -> bool:
    parts = [(key.split("/")[-1], *data.series(key)) for key in K.TIME_SPLIT]
    parts = [p for p in parts if p[1]]
    step_steps, step_times = data.series(K.TIME_STEP)
    if not parts and not step_steps:
        return False
    ax = fig.subplots()
    if parts:
        steps = sorted(set().union(*(p[1] for p in parts)))
        stacks = [[dict(zip(s, v)).get(x, 0.0) for x in steps] for _, s, v in parts]
        ax.stackplot(steps, *stacks, labels=[name for name, _, _ in parts], alpha=0.8)
    if step_steps:
        ax.plot(step_steps, step_times, color="black", linewidth=1.5, label="step (wall)")
    ax.set_title("step time split (s); parts overlap in async modes")
    ax.set_ylabel("seconds")
    _style(ax, legend="upper left")
    return True


def draw_train(data: RunData, fig: Figure) -> bool:
    items = [(k, label) for k, label in ((K.TRAIN_LOSS, "loss"), (K.GRAD_NORM, "grad norm"),
                                         (K.ENTROPY, "entropy"), (K.KL_REF, "KL to reference")) if data.has(k)]
    if not items:
        return False
    for ax, item in zip(fig.subplots(1, len(items), squeeze=False)[0], items):
        _lines(ax, data, [item])
        ax.set_title(item[1])
    return True


def draw_eval(data: RunData, fig: Figure) -> bool:
    """Held-out reward and pass@k per evaluated step, each with its 95% bootstrap interval."""
    names = [K.EVAL_REWARD] + sorted(k for k in data.keys(None) if k.startswith(K.EVAL_PASS_PREFIX)
                                     and k.count("_") == 0)
    names = [n for n in names if data.has(n, None)]
    if not names:
        return False
    ax = fig.subplots()
    for name in names:
        steps, values = data.series(name, None)
        line, = ax.plot(steps, values, marker="o", label=name.removeprefix("eval/"))
        lo, hi = data.series(f"{name}_ci_low", None), data.series(f"{name}_ci_high", None)
        if lo[0] and lo[0] == hi[0]:
            ax.fill_between(lo[0], lo[1], hi[1], color=line.get_color(), alpha=0.2)
    ax.set_title("held-out eval (shaded: 95% bootstrap interval over tasks)")
    ax.set_ylim(-0.02, 1.02)
    _style(ax)
    return True


# (file stem, title, draw, figure size); order is the page order.
FIGURES: list[tuple[str, str, Draw, tuple[float, float]]] = [
    ("reward", "Reward", draw_reward, (12, 4)),
    ("tool_use", "Tool-use rate", _single("tool-use rate", [(K.TOOL_USE_RATE, "episodes calling a tool")],
                                          ylim=(-0.02, 1.02)), (7, 4)),
    ("staleness", "Staleness", _single("staleness of groups trained on (versions)",
                                       [(K.STALENESS_AVG, "avg"), (K.STALENESS_MAX, "max")]), (7, 4)),
    ("queue", "Buffer queue size", _single("buffer queue size (groups)", [(K.QUEUE_SIZE, "queue size")]), (7, 4)),
    ("tis", "Train-rollout mismatch (TIS)", draw_tis, (12, 4)),
    ("step_time", "Step time", draw_step_time, (9, 4.5)),
    ("eval", "Eval reward", draw_eval, (7, 4)),
    ("sft_loss", "SFT warm start", _single("SFT loss", [(K.SFT_LOSS, "loss")], kind="sft"), (7, 4)),
    ("opd", "On-policy distillation", _single("per-token reverse KL to the teacher",
                                              [(K.OPD_REVERSE_KL, "reverse KL"),
                                               (K.OPD_SAMPLED_LOG_RATIO, "sampled-token log-ratio")]), (7, 4)),
    ("teacher_sft", "Teacher SFT", _single("teacher SFT loss", [(K.TEACHER_SFT_LOSS, "loss")], kind="teacher"),
     (7, 4)),
    ("train", "Optimisation", draw_train, (12, 3.6)),
]


def render_pngs(data: RunData, out_dir: Path, dpi: int = 110) -> list[tuple[str, Path]]:
    """Write one PNG per figure that has data; returns ``[(title, path)]`` in page order."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, title, draw, size in FIGURES:
        fig = MplFigure(figsize=size, layout="constrained")
        FigureCanvasAgg(fig)
        path = out_dir / f"{stem}.png"
        if draw(data, fig):
            fig.savefig(path, dpi=dpi)
            written.append((title, path))
        else:
            path.unlink(missing_ok=True)  # left by an earlier report of this run
    return written
