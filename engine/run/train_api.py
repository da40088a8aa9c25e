"""The training API over HTTP, under /api of `edgetune serve` (engine/run/serve_app.py): the
operations of engine/run/api.py for other programs. /openapi.json describes them.

    GET  /api/presets                       the presets, with their descriptions
    GET  /api/runs                          every run's summary, newest first
    POST /api/runs                          start a run: {"preset", "set": ["key=value", ...], "name"}
    GET  /api/runs/{name}                   one run's summary
    GET  /api/runs/{name}/events            its events from ?start=; with ?follow=true as server-sent
                                            events, live, until the run ends
    POST /api/runs/{name}/stop              graceful: the step ends, the adapter is saved
    POST /api/runs/{name}/export            {"out", "merged", "zip", "force"}: as `edgetune export`
    POST /api/evaluations                   grade the base and/or runs: {"runs", "base", "tasks", "preset", "set"}
    GET  /api/evaluations/{name}            its status, progress and, once finished, its result

Runs start in the served runs folder only (--runs-dir). A setting that runs Python other
than edgetune's (a reward_file, model.trust_remote_code) is refused unless `edgetune serve
--allow-code` named that file or model, as `edgetune resume` does. Errors are one line in
the same shape as the OpenAI endpoints': {"error": {"message", "type", "code", "param"}}.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from edgetune.engine.core.errors import EdgetuneError
from edgetune.engine.core.runfolder import check_run_name

from edgetune.engine.run import api, eval_jobs


class StartRun(BaseModel):
    preset: str | None = Field(None, description="a preset name (GET /api/presets)")
    set: list[str] = Field(default_factory=list, description="settings as `edgetune train --set` takes them: "
                                                             "key=value")
    name: str | None = Field(None, description="the run's folder name (default: the method and the time)")


class Export(BaseModel):
    out: str = Field(description="a new or empty folder (with zip: a file)")
    merged: bool = Field(False, description="also the adapter folded into a copy of the base")
    zip: bool = False
    force: bool = Field(False, description="replace a previous export at `out` (nothing else)")


class Evaluate(BaseModel):
    runs: list[str] = Field(default_factory=list, description="run names to grade")
    base: bool = Field(False, description="grade the base too")
    tasks: list[str] = Field(default_factory=lambda: ["held-out"], description="as `edgetune eval --task`")
    preset: str | None = Field(None, description="the settings it grades with: a preset ...")
    set: list[str] = Field(default_factory=list, description="... and key=value settings")


class Refused(EdgetuneError):
    """An operation refused with an HTTP status (the one line is the message)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except (OSError, RuntimeError):
        return False


def router(runs_dir: str, allow_code: tuple[str, ...] = ()) -> APIRouter:
    r = APIRouter(tags=["training"])

    def run_of(name: str) -> api.Run:
        try:
            check_run_name(name)
        except EdgetuneError:
            raise Refused(404, f"no run '{name}' in {runs_dir}", "run_not_found") from None
        path = Path(runs_dir) / name
        if not (path / "config.yaml").is_file():
            raise Refused(404, f"no run '{name}' in {runs_dir}", "run_not_found")
        return api.Run(path)

    def config(preset: str | None, sets: list[str]):
        cfg = api.resolve(preset=preset, overrides=list(sets))
        cfg.run.runs_dir = runs_dir  # runs start where this server serves them, nowhere else
        for setting, what in api.code_it_runs(cfg):
            if not any(_same(what, a) for a in allow_code):
                raise Refused(403, f"{setting} runs the Python of {what}: start it on the command line, or serve "
                                   f"with --allow-code {what}", "code_not_allowed")
        return cfg

    @r.get("/presets")
    def presets() -> list[dict]:
        """The presets a run can start from."""
        from edgetune.engine.core.config_files import list_presets, preset_description

        return [{"name": n, "description": preset_description(p)} for n, p in list_presets().items()]

    @r.get("/runs")
    def runs() -> list[dict]:
        """Every run's summary (status, method, model, step, metrics), newest first."""
        return api.summaries(runs_dir)

    @r.post("/runs", status_code=201)
    async def start(body: StartRun) -> dict:
        """Start a run from a preset and settings; it trains in its own process."""
        cfg = config(body.preset, body.set)
        run = await asyncio.to_thread(api.start, cfg, body.name)
        return run.summary()

    @r.get("/runs/{name}")
    def one(name: str) -> dict:
        return run_of(name).summary()

    @r.get("/runs/{name}/events")
    async def events(name: str, start: int = Query(0, ge=0), follow: bool = False):
        """The run's events from index `start`; with follow, a text/event-stream of them as
        they are written, ending with the run."""
        run = run_of(name)
        if not follow:
            return list(run.events(start))
        return StreamingResponse(_follow(run, start), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @r.post("/runs/{name}/stop")
    def stop(name: str) -> dict:
        """Stop gracefully: the worker finishes its step and saves the adapter."""
        run = run_of(name)
        if run.status() not in api.ACTIVE:
            raise Refused(409, f"run '{name}' is {run.status()}, not training", "run_not_active")
        run.stop()
        return {"name": name, "stopping": True}

    @r.post("/runs/{name}/export")
    async def export(name: str, body: Export) -> dict:
        """Copy the run's adapter (PEFT format) to `out`, as `edgetune export` does."""
        run = run_of(name)
        out = await asyncio.to_thread(api.export, run.path, body.out, merged=body.merged, as_zip=body.zip,
                                      force=body.force, isolated=True)
        return {"name": name, "out": str(out)}

    @r.post("/evaluations", status_code=201)
    def evaluate(body: Evaluate) -> dict:
        """Grade the base and/or runs on tasks, in a job of its own process (GET it for its result)."""
        cfg = config(body.preset, body.set)
        job = eval_jobs.start(cfg, body.base, [(n, str(run_of(n).path)) for n in body.runs], body.tasks, runs_dir)
        return {"name": job.name, "status": job.status()}

    @r.get("/evaluations/{name}")
    def evaluation(name: str) -> dict:
        path = eval_jobs.evals_dir(runs_dir) / name
        try:
            check_run_name(name)
        except EdgetuneError:
            path = Path("/nonexistent")
        if not (path / "request.json").is_file():
            raise Refused(404, f"no evaluation '{name}' in {eval_jobs.evals_dir(runs_dir)}", "evaluation_not_found")
        job = eval_jobs.EvalJob(path)
        return {"name": name, "status": job.status(), "progress": job.progress(), "error": job.error() or None,
                "result": job.result()}

    return r


async def _follow(run: api.Run, start: int):
    """Server-sent events of a run, read on a thread as the file grows."""
    queue: asyncio.Queue = asyncio.Queue()
    loop = asyncio.get_running_loop()
    stopped = []

    def read():
        try:
            for ev in run.events(start, follow_live=True):
                if stopped:
                    return
                loop.call_soon_threadsafe(queue.put_nowait, ev)
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    reader = loop.run_in_executor(None, read)
    try:
        while (ev := await queue.get()) is not None:
            yield f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"
        yield "event: end\ndata: {}\n\n"
    finally:
        stopped.append(True)
        del reader
