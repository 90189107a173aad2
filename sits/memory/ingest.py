"""Documents into a memory set: paragraphs packed into chunks of at most ``chunk_chars``, each with
its source, index and content hash. Re-ingesting a folder changes only what changed: chunks whose
file changed or vanished are forgotten (the set's history keeps them), new ones are added."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from sits.memory.vectors import MemoryStore

SUFFIXES = (".md", ".txt", ".rst")


def chunks(text: str, chunk_chars: int) -> list[str]:
    paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    out: list[str] = []
    cur = ""
    for p in (p for p in paras if p):
        while len(p) > chunk_chars:                    # one very long paragraph: cut it
            if cur:
                out.append(cur)
                cur = ""
            out.append(p[:chunk_chars])
            p = p[chunk_chars:]
        if cur and len(cur) + 1 + len(p) > chunk_chars:
            out.append(cur)
            cur = p
        else:
            cur = f"{cur} {p}".strip()
    if cur:
        out.append(cur)
    return out


def ingest_dir(store: MemoryStore, set_name: str, root: str | Path, chunk_chars: int = 600, *,
               embedder: str | None = None) -> dict:
    root = Path(root).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    wanted: dict[str, dict] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES):
        if not path.resolve().is_relative_to(root):      # a symlink out of the folder is not the folder's
            continue
        rel = str(path.relative_to(root))
        for i, c in enumerate(chunks(path.read_text(encoding="utf-8", errors="replace"), chunk_chars)):
            sha = hashlib.sha256(c.encode()).hexdigest()[:16]
            wanted[f"{rel}#{sha}"] = {"text": c, "meta": {"source": rel, "chunk": i, "sha": sha, "root": str(root)}}
    # only this folder's chunks can go stale (another unit may ingest another folder into the same set)
    have = {f"{h.meta.get('source')}#{h.meta.get('sha')}": h for h in store.list(set_name)
            if "sha" in h.meta and h.meta.get("root") == str(root)}
    stale = [h for key, h in have.items() if key not in wanted]
    for h in stale:
        store.forget(set_name, h.id)
    new = [v for key, v in wanted.items() if key not in have]
    store.add(set_name, [v["text"] for v in new], [v["meta"] for v in new], embedder=embedder)
    return {"set": set_name, "files": len({v["meta"]["source"] for v in wanted.values()}), "chunks": len(wanted),
            "added": len(new), "forgotten": len(stale), "unchanged": len(wanted) - len(new)}
