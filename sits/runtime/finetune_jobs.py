"""Fine-tuning jobs the gateway runs: a unit kind whose work is training, not serving.

Each job runs as a supervisor process of its own (``python -m sits.finetune.supervisor``: attempts
forked from it, restarted from the job's snapshot when they die), in ``<data-dir>/finetune/<name>``.
Its state is what its events say (queued → running → checkpointed … → done | failed; serving →
served | serve_failed when it names a unit for its adapter; or cancelled). At most ``concurrency`` jobs train at
once (they share the cores with serving); the others wait in order. Submitting a job whose folder
holds a snapshot of the same spec continues it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from sits.engine.errors import SitsError
from sits.finetune.spec import FinetuneSpec

log = logging.getLogger("sits.runtime")
TERMINAL = ("served", "serve_failed", "done", "failed", "cancelled")     # "serving" is not: its adapter is on its way


class JobNotFoundError(SitsError):
    code = "job_not_found"
    http_status = 404


class JobActiveError(SitsError):
    code = "job_active"
    http_status = 409


@dataclass
class _Job:
    spec: FinetuneSpec
    folder: Path
    created_at: float = field(default_factory=time.time)
    state: str = "queued"
    proc: asyncio.subprocess.Process | None = None
    task: asyncio.Task | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)     # set, then replaced, at every change
    first_event: int = 0                 # this submission's first line of the folder's events (a resubmit appends)

    def bump(self) -> None:
        """Wake every follower (each waits on the event it saw; nobody clears it under another)."""
        done, self.changed = self.changed, asyncio.Event()
        done.set()

    def events(self) -> list[dict]:
        path = self.folder / "events.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines()[self.first_event:]:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:      # a line being written, or a torn one: not an event yet
                continue
        return out


class FinetuneJobs:
    def __init__(self, folder: str | Path, serve: Callable[[str, str, str], Awaitable[None]], concurrency: int = 1):
        """``serve(unit, adapter name, adapter folder)`` hot-loads a finished job's adapter."""
        self.folder = Path(folder)
        self.serve = serve
        self.jobs: dict[str, _Job] = {}
        self._slots = asyncio.Semaphore(concurrency)

    def _note(self, job: _Job, state: str, **data) -> None:
        """A state the gateway itself decides (queued, served, cancelled), written with the job's own."""
        job.state = state
        job.folder.mkdir(parents=True, exist_ok=True)
        with open(job.folder / "events.jsonl", "a") as f:
            f.write(json.dumps({"state": state, "at": time.time(), "job": job.spec.name, **data}) + "\n")
        job.bump()

    async def submit(self, spec: FinetuneSpec) -> dict:
        old = self.jobs.get(spec.name)
        if old is not None and old.state not in TERMINAL:
            raise JobActiveError(f"fine-tuning job {spec.name!r} is {old.state}; cancel it first", param="name")
        job = self.jobs[spec.name] = _Job(spec, self.folder / spec.name)
        path = job.folder / "events.jsonl"
        job.first_event = len(path.read_text().splitlines()) if path.exists() else 0
        self._note(job, "queued")
        job.task = asyncio.get_running_loop().create_task(self._run(job), name=f"finetune-{spec.name}")
        job.task.add_done_callback(lambda _: job.bump())      # followers see the end, whatever it was
        return self.view(spec.name)

    async def _run(self, job: _Job) -> None:
        try:
            await self._train(job)
        except asyncio.CancelledError:
            raise
        except Exception as e:      # noqa: BLE001 - the job failed, the gateway serves on
            log.exception("fine-tuning job %s", job.spec.name)
            self._note(job, "failed", error=f"{type(e).__name__}: {e}")

    async def _train(self, job: _Job) -> None:
        async with self._slots:
            if job.state == "cancelled":
                return
            spec_path = job.folder / "spec.json"
            spec_path.write_text(job.spec.model_dump_json())
            job.state = "running"
            job.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sits.finetune.supervisor", str(spec_path), str(job.folder),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            if job.state == "cancelled":        # cancelled while the process was starting
                job.proc.terminate()
            watcher = asyncio.get_running_loop().create_task(self._watch(job))
            try:
                _, stderr = await job.proc.communicate()
            finally:
                watcher.cancel()
            if job.state == "cancelled":
                return
            if job.proc.returncode != 0:
                last = (job.events() or [{}])[-1]
                if last.get("state") != "failed":
                    self._note(job, "failed", error=stderr.decode(errors="replace")[-2000:] or
                               f"exit status {job.proc.returncode}")
                job.state = "failed"
                job.bump()
                return
            job.state = "serving" if job.spec.serve_into else "done"
            job.bump()
            if job.spec.serve_into:
                adapter = str(job.folder / "adapter")
                try:
                    await self.serve(job.spec.serve_into, job.spec.name, adapter)
                except SitsError as e:
                    self._note(job, "serve_failed", error=e.message, code=e.code)
                    return
                self._note(job, "served", unit=job.spec.serve_into, model=f"{job.spec.serve_into}:{job.spec.name}")

    async def _watch(self, job: _Job) -> None:
        """Wake event readers as the job's own events arrive (the file is the job's channel)."""
        seen = -1
        while True:
            n = len(job.events())
            if n != seen:
                seen = n
                job.bump()
            await asyncio.sleep(0.2)

    def _job(self, name: str) -> _Job:
        job = self.jobs.get(name)
        if job is None:
            raise JobNotFoundError(f"no fine-tuning job {name!r}", param="name")
        return job

    def view(self, name: str) -> dict:
        job = self._job(name)
        events = job.events()
        last_train = next((e for e in reversed(events) if "step" in e), {})
        losses = [e["loss"] for e in events if e.get("loss") is not None]
        return {"id": name, "object": "finetune.job", "state": job.state, "created_at": job.created_at,
                "model": job.spec.model, "dataset": job.spec.dataset, "step": last_train.get("step", 0),
                "steps": job.spec.steps, "loss": losses[-1] if losses else None, "serve_into": job.spec.serve_into,
                "adapter": str(job.folder / "adapter") if (job.folder / "adapter").exists() else None,
                "error": next((e.get("error") for e in reversed(events) if e.get("error")), None)
                if job.state in ("failed", "serve_failed") else None,
                "events": len(events)}

    def views(self) -> list[dict]:
        return [self.view(n) for n in self.jobs]

    async def follow(self, name: str) -> AsyncIterator[dict]:
        """The job's events from its first, then as they come, until it ends."""
        job = self._job(name)
        sent = 0
        while True:
            changed = job.changed
            events = job.events()
            for ev in events[sent:]:
                yield ev
            sent = len(events)
            if job.state in TERMINAL and (job.task is None or job.task.done()):
                return
            await changed.wait()

    async def cancel(self, name: str) -> dict:
        job = self._job(name)
        if job.state in TERMINAL:
            return self.view(name)
        self._note(job, "cancelled")
        if job.proc is None:
            job.task.cancel()        # still waiting for its turn
        elif job.proc.returncode is None:
            job.proc.terminate()     # the supervisor's attempt dies with it; the snapshot stays for a later submit
        return self.view(name)

    async def close(self) -> None:
        for job in self.jobs.values():
            if job.proc is not None and job.proc.returncode is None:
                job.proc.terminate()
            if job.task is not None:
                job.task.cancel()
        await asyncio.gather(*(j.task for j in self.jobs.values() if j.task is not None), return_exceptions=True)


__all__ = ["FinetuneJobs", "JobNotFoundError", "JobActiveError", "TERMINAL"]
