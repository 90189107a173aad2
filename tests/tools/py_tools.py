"""Test-only Python tools (run in a subprocess by the sandbox)."""
import time


def echo(text: str) -> dict:
    return {"echo": text}


def slow() -> str:
    time.sleep(30)
    return "never"
