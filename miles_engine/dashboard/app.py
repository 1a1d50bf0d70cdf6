"""The dashboard's FastAPI app: server-side pages (jinja2) and one JSON endpoint the overview polls.

Read-only: every route is a GET over the run directories given at start. With ``follow`` each
request first reads what the runs appended since the previous one.
"""


import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from miles_engine.dashboard import charts, views
from miles_engine.dashboard.data import GROUP_FILTERS, TRAJECTORY_SORTS, NotFound, RunView, open_runs

GROUPS_PER_PAGE = 25
TRAJECTORIES_PER_PAGE = 20
RECENT_STEPS = 40


class RunGone(Exception):
    """A run directory was removed (or moved) while the dashboard was serving it."""


def plotly_js() -> Path:
    """The ``plotly`` package's own bundle, served as-is (nothing fetched at view time)."""
    import plotly

    path = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise RuntimeError(f"the plotly package at {path.parent.parent} has no package_data/plotly.min.js")
    return path


def _fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) else "–"
    return str(v)


def create_app(run_dirs: Sequence[Path], *, follow: bool = False) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
    from fastapi.staticfiles import StaticFiles
    from fastapi.templating import Jinja2Templates

    runs = open_runs([Path(p) for p in run_dirs])
    package = resources.files("miles_engine.dashboard")
    templates = Jinja2Templates(directory=str(package / "templates"))
    templates.env.filters["fmt"] = _fmt
    templates.env.globals.update(follow=follow, runs=runs)
    app = FastAPI(title="miles dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=str(package / "static")), name="static")
    plotly_path = plotly_js()

    def current(index: int | None = None) -> list[RunView]:
        chosen = runs if index is None else [run_at(index)]
        for run in chosen:
            if not run.exists():
                raise RunGone(f"the run directory {run.run_dir} was removed (or moved) while being viewed; "
                              "restart `miles dashboard` with a run directory that exists")
            if follow:
                run.refresh()
        return chosen

    def run_at(index: int) -> RunView:
        if not 0 <= index < len(runs):
            raise NotFound(f"no run {index}: this dashboard serves runs 0..{len(runs) - 1}")
        return runs[index]

    def page(request: Request, name: str, status: int = 200, **context: Any) -> Any:
        return templates.TemplateResponse(request, name, context, status_code=status)

    @app.exception_handler(RunGone)
    async def _gone(request: Request, exc: RunGone) -> Any:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": str(exc)}, status_code=410)
        return page(request, "error.html", 410, title="Run removed", message=str(exc))

    @app.exception_handler(NotFound)
    async def _missing(request: Request, exc: NotFound) -> Any:
        return page(request, "error.html", 404, title="Not found", message=str(exc))

    @app.exception_handler(Exception)
    async def _failed(request: Request, exc: Exception) -> Any:  # logged by the server; the reader gets one line
        return page(request, "error.html", 500, title="The dashboard failed on this page",
                    message=f"{type(exc).__name__}: {exc}")

    @app.exception_handler(FileNotFoundError)
    async def _file_gone(request: Request, exc: FileNotFoundError) -> Any:
        return page(request, "error.html", 410, title="Run removed",
                    message=f"a file of the run is gone ({exc.filename or exc}); was the run directory removed?")

    @app.get("/static-lib/plotly.min.js")
    def plotly_bundle() -> Any:
        return FileResponse(plotly_path, media_type="text/javascript",
                            headers={"Cache-Control": "public, max-age=86400"})

    @app.get("/api/curves")
    def curves(v: str = "") -> Any:
        chosen = current()
        version = ".".join(f"{a}-{b}" for a, b in (r.version for r in chosen))
        if v == version:
            return {"version": version, "unchanged": True}
        return {"version": version, "charts": charts.figures(chosen),
                "last_steps": {r.name: max(r.steps(), default=0) for r in chosen}}

    @app.get("/", response_class=HTMLResponse)
    def overview(request: Request) -> Any:
        chosen = current()
        version = ".".join(f"{a}-{b}" for a, b in (r.version for r in chosen))
        return page(request, "overview.html", charts_data={"version": version, "charts": charts.figures(chosen)},
                    recent={r.index: r.steps()[-RECENT_STEPS:] for r in chosen})

    @app.get("/run/{index}/step/{step}", response_class=HTMLResponse)
    def step_page(request: Request, index: int, step: int, page_no: int = 1, show: str = "all",
                  kind: str = "", tsort: str = "reward", tdesc: int = 0, tpage: int = 1) -> Any:
        run = current(index)[0]
        if show not in GROUP_FILTERS:
            show = "all"
        if tsort not in TRAJECTORY_SORTS:
            tsort = "reward"
        tpages = max(1, math.ceil(len(run.step_records(step)) / TRAJECTORIES_PER_PAGE))
        tpage = min(max(1, tpage), tpages)
        ranked = run.ranked(step, tsort, bool(tdesc), (tpage - 1) * TRAJECTORIES_PER_PAGE, TRAJECTORIES_PER_PAGE)
        every = run.groups(step)
        groups = run.groups(step, show, kind or None)
        pages = max(1, math.ceil(len(groups) / GROUPS_PER_PAGE))
        page_no = min(max(1, page_no), pages)
        steps = run.steps()
        pos = steps.index(step) if step in steps else -1
        return page(request, "step.html", run=run, step=step, show=show, kind=kind, filters=GROUP_FILTERS,
                    groups=groups[(page_no - 1) * GROUPS_PER_PAGE: page_no * GROUPS_PER_PAGE],
                    page_no=page_no, pages=pages, matching=len(groups),
                    kinds=sorted({g.kind for g in every}),
                    counts={"groups": len(every), "trajectories": sum(len(g.members) for g in every),
                            "zero_variance": sum(g.zero_variance for g in every),
                            "filtered": sum(g.filtered is not None for g in every),
                            "failed": sum(len(g.failed) for g in every)},
                    prev_step=steps[pos - 1] if pos > 0 else None,
                    next_step=steps[pos + 1] if 0 <= pos < len(steps) - 1 else None,
                    metrics=run.data.by_kind.get("train", {}).get(step, {}), ranked=ranked, tsort=tsort,
                    tdesc=int(bool(tdesc)), tpage=tpage, tpages=tpages, sorts=TRAJECTORY_SORTS)

    @app.get("/run/{index}/traj/{rid}", response_class=HTMLResponse)
    def trajectory_page(request: Request, index: int, rid: int, tpage: int = 1) -> Any:
        run = current(index)[0]
        record = run.trajectory(rid)
        tokens = views.token_page(record, tpage)
        command_rows, timeline = views.commands(record)
        summary = {k: v for k, v in record.items() if k not in _BODY_KEYS}
        return page(request, "trajectory.html", run=run, rec=record, summary=summary, tokens=tokens,
                    measures=views.MEASURES, messages=views.messages(record), commands=command_rows,
                    timeline=timeline, components=record.get("reward_components") or {})

    @app.get("/eval", response_class=HTMLResponse)
    def eval_page(request: Request, a: str = "", b: str = "") -> Any:
        chosen = current()
        files = [(r.index, step, path) for r in chosen for step, path in r.eval_files().items()]
        keys = [f"{i}:{s}" for i, s, _ in files]
        pair = None
        if len(files) >= 2:
            a = a if a in keys else keys[0]
            b = b if b in keys else keys[-1]
            ea = views.load_eval(*files[keys.index(a)])
            eb = views.load_eval(*files[keys.index(b)])
            pair = {"a": ea, "b": eb, **views.compare(ea, eb)}
        summaries = [views.load_eval(*f) for f in files]
        return page(request, "eval.html", rows={r.index: charts.eval_rows(r) for r in chosen}, files=summaries,
                    pair=pair, single=summaries[0] if len(summaries) == 1 else None, a=a, b=b, keys=keys)

    return app


_BODY_KEYS = frozenset({"token_ids", "pieces", "loss_mask", "rollout_logprobs", "trainer_logprobs", "weight_versions",
                        "messages", "commands", "reward_components", "routed_experts"})

