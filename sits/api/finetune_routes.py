"""Fine-tuning jobs on ``sits up``'s gateway: ``/v1/finetune/jobs`` (submit a ``kind: finetune`` spec,
list, view, follow its events as SSE, cancel). Operator-only, as the control API is: a job names
folders on the server."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from sits.api.auth import require_operator
from sits.api.errors import error_docs
from sits.api.sse import SSEResponse, sse_event
from sits.engine.errors import InvalidRequestError
from sits.finetune.spec import FinetuneSpec
from sits.runtime.finetune_jobs import FinetuneJobs

ERRORS = error_docs({
    400: "an invalid job spec",
    403: "an admin key is needed",
    404: "no such job",
    409: "a job of that name is queued or running",
})
router = APIRouter(tags=["finetune"], dependencies=[Depends(require_operator)], responses=ERRORS)


def _jobs(request: Request) -> FinetuneJobs:
    return request.app.state.gateway.finetune


@router.post("/v1/finetune/jobs", status_code=201)
async def submit_job(body: dict[str, Any], request: Request) -> JSONResponse:
    body = dict(body)
    if body.pop("kind", "finetune") != "finetune":
        raise InvalidRequestError("kind must be finetune", param="kind", code="invalid_parameter")
    try:
        spec = FinetuneSpec.model_validate(body)
    except ValueError as e:
        raise InvalidRequestError(f"invalid fine-tuning job: {e}", param="spec", code="invalid_job") from None
    return JSONResponse(await _jobs(request).submit(spec), status_code=201)


@router.get("/v1/finetune/jobs")
async def list_jobs(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": _jobs(request).views()}


@router.get("/v1/finetune/jobs/{name}")
async def get_job(name: str, request: Request) -> dict[str, Any]:
    return _jobs(request).view(name)


@router.get("/v1/finetune/jobs/{name}/events", responses={
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
          "description": "SSE: one `event: <state>` per job event (queued, running, checkpointed, done, "
                         "served, failed, cancelled) until the job ends"}})
async def follow_job(name: str, request: Request):
    jobs = _jobs(request)
    jobs.view(name)                                   # 404 before the stream starts

    async def body():
        async for i, ev in _numbered(jobs.follow(name)):
            yield sse_event(ev, event_id=i, event=ev.get("state"))

    return SSEResponse(body())


async def _numbered(events):
    i = 0
    async for ev in events:
        i += 1
        yield i, ev


@router.delete("/v1/finetune/jobs/{name}")
async def cancel_job(name: str, request: Request) -> dict[str, Any]:
    return await _jobs(request).cancel(name)
