"""A dataset folder as training examples: token ids and which of them the loss counts.

Each ``*.jsonl`` line is a chat (``{"messages": [...]}``: the loss counts the last assistant turn, the
conversation before it is the context, rendered with the model's chat template) or a text
(``{"text": "..."}``: every token counts). Files are read in name order, so the examples and their
order are the same on every run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sits.engine.errors import InvalidRequestError
from sits.engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Example:
    ids: list[int]
    first_target: int          # positions before this one are context (no loss)


def load_examples(folder: str | Path, tokenizer: Tokenizer, max_len: int) -> list[Example]:
    path = Path(folder)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise InvalidRequestError(f"dataset {folder}: no *.jsonl files", param="dataset", code="invalid_dataset")
    out: list[Example] = []
    for f in files:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ex = _example(row, tokenizer, max_len)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise InvalidRequestError(f"{f.name}:{n}: not a chat or text example ({e})", param="dataset",
                                          code="invalid_dataset") from None
            if ex is not None:
                out.append(ex)
    if not out:
        raise InvalidRequestError(f"dataset {folder} has no usable examples", param="dataset", code="invalid_dataset")
    return out


def _example(row: dict, tokenizer: Tokenizer, max_len: int) -> Example | None:
    if "messages" in row:
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        context = tokenizer.encode_chat(messages[:last])
        full = tokenizer.encode_chat(messages[:last + 1], add_generation_prompt=False)
        first = 0
        while first < min(len(context), len(full)) and full[first] == context[first]:
            first += 1                          # a template that renders earlier turns otherwise: what they share
        ids, first = full[:max_len], max(first, 1)
    else:
        ids, first = tokenizer.encode(str(row["text"]))[:max_len], 1
    return Example(ids, first) if len(ids) > first else None
