"""Tool contracts and the WASM sandbox: semver matching, the built-in tools, and escapes tried and
refused (path traversal, an undeclared directory, a symlink out, a write to a read-only mount, an
infinite loop, a memory bomb), each with a clear error and the runtime unharmed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sits.tools import ToolError, ToolRegistry, run_tool
from sits.tools.semver import Constraint, SemverError, Version, split_ref

TEST_TOOLS = Path(__file__).parent / "tools"


@pytest.fixture(scope="module")
def registry():
    return ToolRegistry([TEST_TOOLS])


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    (root / "notes.txt").write_text("the notes\n")
    (tmp_path / "secret.txt").write_text("outside the mount\n")
    os.symlink(tmp_path / "secret.txt", root / "link-out.txt")
    return root


@pytest.mark.parametrize("constraint,yes,no", [
    ("^1.2", ["1.2.0", "1.9.3"], ["1.1.9", "2.0.0"]),
    ("^0.2.1", ["0.2.1", "0.2.9"], ["0.3.0", "0.2.0"]),
    ("~1.2", ["1.2.0", "1.2.7"], ["1.3.0"]),
    (">=1.0,<2", ["1.0.0", "1.99.0"], ["0.9.9", "2.0.0"]),
    ("1.x", ["1.0.0", "1.5.2"], ["2.0.0"]),
    ("1.2.3", ["1.2.3"], ["1.2.4"]),
    ("*", ["0.0.1", "9.9.9"], []),
    (">1.2.3", ["1.2.4"], ["1.2.3"]),
])
def test_semver_constraints(constraint, yes, no):
    c = Constraint.parse(constraint)
    assert all(c.allows(Version.parse(v)) for v in yes)
    assert not any(c.allows(Version.parse(v)) for v in no)


def test_bad_refs_and_versions():
    with pytest.raises(SemverError):
        Version.parse("1.2")
    with pytest.raises(SemverError):
        Constraint.parse("^x.1")
    with pytest.raises(SemverError):
        split_ref("File.Read@1")
    assert split_ref("file.read") == ("file.read", "*")


def test_resolution_and_unit_allow_lists(registry):
    assert registry.resolve("test.write@*").version == "0.2.0"          # the highest match
    assert registry.resolve("test.write@^0.1").version == "0.1.0"
    with pytest.raises(ToolError) as e:
        registry.resolve("file.read@^2")
    assert e.value.code == "tool_not_found" and "1.2.0" in e.value.message
    assert [c.ref for c in registry.allowed(["file.read@^1.2"], ["file.read@1.x", "math.eval@^1"])] == ["file.read@1.2.0"]
    with pytest.raises(ToolError) as e:
        registry.allowed(["math.eval@^1"], ["file.read@^1"])
    assert e.value.code == "tool_not_allowed"
    with pytest.raises(ToolError) as e:                                 # the unit pins 0.1, the request wants 0.2
        registry.allowed(["test.write@^0.2"], ["test.write@~0.1"])
    assert e.value.code == "tool_not_allowed"


def test_builtins_run(registry, data):
    r = run_tool(registry.resolve("math.eval@^1"), {"expression": "(2 + 3) * 7 - 10 / 3"})
    assert r.output.strip() == "32" and r.fuel_used > 0
    r = run_tool(registry.resolve("file.read@^1.2"), {"path": "/data/notes.txt"}, dirs={"/data": str(data)})
    assert r.output == "the notes\n"
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("math.eval@^1"), {"expression": "1/0"})
    assert e.value.code == "tool_failed" and "division by zero" in e.value.message
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("math.eval@^1"), {"expression": "import os"})
    assert e.value.code == "invalid_tool_arguments" and "expression" in e.value.message


@pytest.mark.parametrize("path", ["../secret.txt", "/data/../secret.txt", "/etc/passwd", "/tmp", "link-out.txt",
                                  "/data/link-out.txt"])
def test_file_access_outside_the_declared_directory_is_refused(registry, data, path):
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("file.read@^1.2"), {"path": path}, dirs={"/data": str(data)})
    assert e.value.code == "tool_failed" and "cannot open the path" in e.value.message
    assert "outside the mount" not in e.value.message


def test_a_declared_directory_must_be_mapped(registry):
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("file.read@^1.2"), {"path": "/data/notes.txt"}, dirs={})
    assert e.value.code == "tool_misconfigured"


def test_write_to_a_read_only_mount_is_refused_and_a_writable_one_works(registry, data):
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("test.write@0.1.0"), {}, dirs={"/data": str(data)})
    assert e.value.code == "tool_failed" and not (data / "out.txt").exists()
    run_tool(registry.resolve("test.write@0.2.0"), {}, dirs={"/data": str(data)})
    assert (data / "out.txt").read_text() == "written by a tool\n"


def test_infinite_loop_is_stopped_by_the_deadline_and_by_fuel(registry):
    t0 = time.monotonic()
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("test.spin"), {})
    assert e.value.code == "tool_timeout" and time.monotonic() - t0 < 3
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("test.spin-small-fuel"), {})
    assert e.value.code == "tool_fuel_exhausted"


def test_memory_bomb_hits_the_store_limit(registry):
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("test.membomb"), {})
    assert e.value.code == "tool_trap" and "4 MiB" in e.value.message


def test_the_runtime_is_unharmed_after_every_escape(registry, data):
    for _ in range(3):
        for ref, args in (("test.spin", {}), ("test.membomb", {}), ("file.read@^1.2", {"path": "../secret.txt"})):
            with pytest.raises(ToolError):
                run_tool(registry.resolve(ref), args, dirs={"/data": str(data)})
    assert run_tool(registry.resolve("math.eval@^1"), {"expression": "1+1"}).output.strip() == "2"


def test_python_tools_need_an_opt_in_and_keep_the_timeout(registry):
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("test.py-echo"), {"text": "hi"})
    assert e.value.code == "python_tools_disabled"
    r = run_tool(registry.resolve("test.py-echo"), {"text": "hi"}, python_allowed=True)
    assert r.output == '{"echo": "hi"}'
    t0 = time.monotonic()
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("test.py-slow"), {}, python_allowed=True)
    assert e.value.code == "tool_timeout" and time.monotonic() - t0 < 5


def test_limits_cover_the_start_function_tables_and_extra_memories(registry):
    t0 = time.monotonic()
    with pytest.raises(ToolError) as e:
        run_tool(registry.resolve("test.start-loop"), {})
    assert e.value.code == "tool_timeout" and time.monotonic() - t0 < 3
    for ref in ("test.big-table", "test.two-memories"):
        with pytest.raises(ToolError) as e:
            run_tool(registry.resolve(ref), {})
        assert e.value.code in ("tool_trap", "tool_misconfigured"), (ref, e.value.code)


def test_one_calls_deadline_does_not_interrupt_another(registry):
    import concurrent.futures
    slow = registry.resolve("test.spin").model_copy(update={"timeout_ms": 1500})
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long_run = pool.submit(lambda: _elapsed(lambda: run_tool(slow, {})))
        time.sleep(0.05)
        short = _elapsed(lambda: run_tool(registry.resolve("test.spin"), {}))       # 300 ms
        long_s = long_run.result()
    assert short < 1.2 and long_s >= 1.4, (short, long_s)


def _elapsed(call) -> float:
    t0 = time.monotonic()
    with pytest.raises(ToolError):
        call()
    return time.monotonic() - t0


def test_the_runner_kills_a_call_blocked_inside_wasi_and_keeps_serving(registry, data):
    """A module asleep in poll_oneoff is beyond epoch interruption; its worker process is not."""
    import asyncio
    from sits.tools import ToolRunner

    async def scenario():
        runner = ToolRunner()
        try:
            ok = await runner.run(registry.resolve("math.eval@^1"), {"expression": "6*7"})
            assert ok.output.strip() == "42" and ok.ref == "math.eval@1.0.0"
            first_pid = runner.pids()[0]
            t0 = time.monotonic()
            with pytest.raises(ToolError) as e:
                await runner.run(registry.resolve("test.sleep"), {})          # timeout_ms 300, sleeps 60 s
            assert e.value.code == "tool_timeout" and time.monotonic() - t0 < 3
            assert runner.killed == 1
            await asyncio.sleep(0.2)
            with pytest.raises(ProcessLookupError):
                os.kill(first_pid, 0)                                          # the blocked worker is gone
            with pytest.raises(ToolError) as e:                                 # errors cross the process boundary
                await runner.run(registry.resolve("file.read@^1.2"), {"path": "/data/../etc/passwd"},
                                 dirs={"/data": str(data)})
            assert e.value.code in ("tool_failed", "invalid_tool_arguments")
            read = await runner.run(registry.resolve("file.read@^1.2"), {"path": "/data/notes.txt"},
                                    dirs={"/data": str(data)})
            assert read.output == "the notes\n"
        finally:
            await runner.close()
        assert runner.pids() == []

    asyncio.run(scenario())


@pytest.mark.parametrize("document,path,out,code", [
    ({"items": [{"name": "a b", "x": [1, {"y": "z"}]}, {"name": "second"}], "n": 3.5}, "items.0.x.1", '{"y": "z"}', None),
    ({"items": [{"name": "a"}, {"name": "second"}]}, "items.1.name", '"second"', None),
    ({"n": -3.5e2, "t": True, "s": "a,b}"}, "n", "-350.0", None),
    ({"n": 1, "t": True, "s": "a,b}"}, "s", '"a,b}"', None),
    ([[1, 2], [3, [4, 5]]], "1.1.0", "4", None),
    ({"a": 1}, "", '{"a": 1}', None),
    ({"items": []}, "items.0", None, "tool_failed"),
    ({"a": {"b": 1}}, "a.c", None, "tool_failed"),
    ({"a": 1}, "a.b", None, "tool_failed"),
    ({"a": [1]}, "a.x", None, "tool_failed"),
    ('{"a": [1, 2', "a.5", None, "tool_failed"),           # a string document is passed as written
])
def test_json_query(registry, document, path, out, code):
    tool = registry.resolve("json.query@^1")
    if code is None:
        assert run_tool(tool, {"document": document, "path": path}).output == out + "\n"
    else:
        with pytest.raises(ToolError) as e:
            run_tool(tool, {"document": document, "path": path})
        assert e.value.code == code and "json.query:" in e.value.message
