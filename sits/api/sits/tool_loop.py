"""The runtime's tool loop for ``allowed_tools``: model → call → sandbox → result → model, until the
model answers or the step limit is reached.

Every step is a model generation (calls grammar-constrained against the contracts' schemas, so a
call always names a granted tool with arguments its schema accepts), then each call runs in the
sandbox under its contract (``sits.tools.run_tool``). A failed call is not the end: its error goes
back to the model as the tool's result, as a client-side loop would do. The last step allows no
call, so the loop always ends with an answer. Each call and its result are events on the request's
stream (``tool_call``, ``tool_result``) and an ``execute_tool`` span in its trace.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any

from sits.api.backend import Backend
from sits.api.context import ServerContext
from sits.api.generation import Generation
from sits.api.shaping import encode_chat
from sits.api.sits.request_store import TrackedRequest
from sits.engine.sampling_params import SamplingParams
from sits.runtime.message_unit import MessagePrompt
from sits.engine.tool_format import ToolCall, ToolSpec, parse_tool_calls, prose_grammar, tool_call_grammar
from sits.observe import genai, tracing
from sits.tools import ToolContract, ToolError

MAX_RESULT_CHARS = 4000     # of a tool's output, placed in the prompt (the whole output is in the event)


def tool_name(contract: ToolContract) -> str:
    """The function name the model sees for a contract (OpenAI names allow no dots)."""
    return contract.id.replace(".", "_")


@dataclass(slots=True)
class StepResult:
    text: str
    finish_reason: str | None
    calls: list[ToolCall]
    errors: list[dict]


class ToolLoop:
    def __init__(self, ctx: ServerContext, backend: Backend, contracts: list[ToolContract], tr: TrackedRequest, *,
                 priority: int, interactive: bool, accepted_at: float):
        self.ctx, self.backend, self.tr = ctx, backend, tr
        self.contracts = {tool_name(c): c for c in contracts}
        self.specs = [ToolSpec(name, c.description, c.parameters) for name, c in self.contracts.items()]
        self.priority, self.interactive, self.accepted_at = priority, interactive, accepted_at
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        self.last: Generation | None = None

    def first_choice(self, requested: str) -> str:
        """``auto`` / ``required`` / ``none``, or a tool: its id (``math.eval``) or function name."""
        if requested in ("auto", "required", "none"):
            return requested
        name = requested.split("@", 1)[0].replace(".", "_")
        if name not in self.contracts:
            raise ToolError("tool_not_allowed", f"tool_choice {requested!r} is not among allowed_tools "
                                                f"({', '.join(c.ref for c in self.contracts.values())})")
        return name

    async def run(self, messages: list[dict], params: SamplingParams, first_choice: str, max_steps: int,
                  first_ids: list[int] | None = None) -> StepResult:
        """Steps until an answer; returns the answering step (the request's output). ``first_ids``:
        the first step's prompt, already rendered and tokenized while validating."""
        choice = self.first_choice(first_choice)
        ids = first_ids
        for step in range(max_steps + 1):
            if step == max_steps:
                choice = "none"         # out of steps: the model must answer
            result = await self._generate(step, messages, params, choice, ids)
            ids = None
            if not result.calls:
                if result.errors:     # e.g. a call cut off by max_tokens: the answer says so
                    self.tr.tool_steps.append({"step": step, "text": result.text, "calls": [],
                                               "tool_call_errors": result.errors})
                return result
            self.tr.end_step({"step": step, "text": result.text, "calls": [c.openai() for c in result.calls],
                              "tool_call_errors": result.errors or None})
            messages = messages + [{"role": "assistant", "content": None,
                                    "tool_calls": [c.openai() for c in result.calls]}]
            for call in result.calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": await self._execute(step, call)})
            choice = "auto"
        raise AssertionError("unreachable: the last step allows no call")

    async def _generate(self, step: int, messages: list[dict], params: SamplingParams, choice: str,
                        ids: list[int] | None) -> StepResult:
        if ids is None:
            ids = encode_chat(self.backend, messages, tools=self.specs)
        if isinstance(ids, MessagePrompt):     # a remote unit's endpoint holds the model to the choice itself
            ids = ids.with_guidance(choice, None)
        # the last step (choice "none") may not call: prose only, or the model could still write a call
        grammar = tool_call_grammar(self.specs, choice) if choice != "none" else prose_grammar()
        gen = Generation(self.backend, self.ctx.metrics, self.ctx.inflight, f"{self.tr.id}.{step}",
                         [(ids, replace(params, grammar=grammar))], priority=self.priority,
                         interactive=self.interactive, accepted_at=self.accepted_at if step == 0 else time.monotonic())
        self.last = gen
        async for _, ev in gen.events():
            if ev.text:
                self.tr.add_delta(ev.index, ev.text, ev.token_id, step=step)
        for k, v in gen.usage().items():
            if k in self.usage:
                self.usage[k] += v
        ch = gen.choices[0]
        text = "".join(ch.text)
        if choice == "none":
            return StepResult(text, ch.finish_reason, [], [])
        parsed = parse_tool_calls(text, self.specs)
        return StepResult(text, ch.finish_reason, parsed.calls, parsed.errors)

    async def _execute(self, step: int, call: ToolCall) -> str:
        contract = self.contracts[call.name]
        self.tr.add_event("tool_call", {"request_id": self.tr.id, "step": step, "id": call.id, "name": call.name,
                                        "tool": contract.ref, "arguments": call.arguments})
        scope = tracing.current_scope.get()
        trace_id = f"{scope.span.get_span_context().trace_id:032x}" if scope is not None else None
        t0 = time.monotonic()
        error: dict[str, Any] | None = None
        output = ""
        try:      # in a worker process: a call past its deadline is killed with it (sits.tools.runner)
            result = await self.ctx.tool_runner.run(contract, call.arguments, dirs=self.backend.features.tool_dirs,
                                                    trace_id=trace_id,
                                                    python_allowed=self.backend.features.python_tools)
            output = result.output
        except ToolError as e:
            error = {"code": e.code, "message": e.message}
        elapsed_ms = (time.monotonic() - t0) * 1e3
        tracing.stage(f"execute_tool {contract.id}", t0, time.monotonic(), level="L3",
                      error=error["code"] if error else None,
                      attributes={genai.OPERATION: "execute_tool", genai.TOOL_NAME: contract.id,
                                  genai.TOOL_CALL_ID: call.id, genai.TOOL_TYPE: "function",
                                  "sits.tool.ref": contract.ref, "sits.tool.step": step})
        self.tr.add_event("tool_result", {"request_id": self.tr.id, "step": step, "id": call.id, "name": call.name,
                                          "tool": contract.ref, "ok": error is None, "duration_ms": round(elapsed_ms, 3),
                                          **({"error": error} if error else {"output": output})})
        self.tr.record_result(call.id, output if error is None else None, error)
        if error is not None:
            return json.dumps({"error": error})
        return output if len(output) <= MAX_RESULT_CHARS else output[:MAX_RESULT_CHARS] + "\n[output truncated]"
