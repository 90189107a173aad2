"""Tools as contracts: a versioned declaration (arguments schema, timeout, side effects, quotas)
and a WebAssembly module that runs in a wasmtime sandbox bounded by exactly that declaration.

Cross-cutting (DESIGN.md): the runtime and the HTTP layer use it; it imports neither.
"""

from sits.tools.contract import ToolContract, ToolError
from sits.tools.registry import ToolRegistry
from sits.tools.runner import ToolRunner
from sits.tools.sandbox import ToolResult, run_tool

__all__ = ["ToolContract", "ToolError", "ToolRegistry", "ToolResult", "ToolRunner", "run_tool"]
