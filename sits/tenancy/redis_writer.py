"""Writes to Redis that a request's end hands over without waiting (settlements, first tokens, usage
rows): queued in order and sent by one task, a pipeline per batch, so a burst of request ends costs
one connection and a few round trips instead of a task and a connection each. A batch Redis does
not take is sent again (nothing is dropped while the process lives).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, Callable

log = logging.getLogger("sits.tenancy")

Command = Callable[[Any], Any]        # queues its commands on the pipeline it is given


class PipelinedWriter:
    def __init__(self, redis, what: str, batch: int = 256, retry_s: float = 1.0):
        self.redis = redis
        self.what = what
        self.batch = batch
        self.retry_s = retry_s
        self._queue: list[Command] = []
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None

    def put(self, command: Command) -> None:
        """Queue ``command`` (called on the gateway's event loop)."""
        self._queue.append(command)
        if self._task is None:
            self._wake, self._idle = asyncio.Event(), asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sits-redis-{self.what}")
        self._idle.clear()
        self._wake.set()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._queue[:self.batch]
                try:
                    async with self.redis.pipeline(transaction=False) as pipe:
                        for command in batch:
                            queued = command(pipe)
                            if inspect.isawaitable(queued):
                                await queued
                        await pipe.execute(raise_on_error=False)
                except Exception as e:      # Redis unreachable: keep the batch, try again shortly
                    log.warning("%d %s not written to Redis yet (%s: %s); retried in %g s", len(batch), self.what,
                                type(e).__name__, e, self.retry_s)
                    await asyncio.sleep(self.retry_s)
                    continue
                del self._queue[:len(batch)]
            self._idle.set()

    async def drain(self) -> None:
        """Everything queued so far has been written."""
        if self._idle is not None and self._queue:
            await self._idle.wait()

    async def aclose(self, timeout_s: float = 5.0) -> None:
        try:
            await asyncio.wait_for(self.drain(), timeout_s)
        except asyncio.TimeoutError:
            log.error("%d %s could not be written to Redis before shutdown", len(self._queue), self.what)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


__all__ = ["PipelinedWriter"]
