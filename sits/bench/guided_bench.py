"""``sits bench guided``: what grammar-constrained tool calls cost, and what jump-forward buys back.

One engine, one workload of concurrent tool-call requests (``tool_choice: required`` over two
functions, seeded sampling), three modes in alternation so drift on a busy host hits all of them:

- ``free``: the same prompts with no grammar, each generating exactly as many tokens as its guided
  run did (the baseline: same batch shapes, same token count, no masks);
- ``guided``: the grammar's mask every step, one model step per token;
- ``guided+jf``: the same grammar with jump-forward (forced tokens appended without a step each).

Reported as medians over the rounds: ms per output token and request latency, as ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import TYPE_CHECKING

from sits.bench.common import add_bench_command, log, pct, publish
from sits.engine.sampling_params import SamplingParams

if TYPE_CHECKING:    # torch, the engine and the grammar code load when the benchmark runs, not with `sits --help`
    from sits.engine.llm_engine import LLMEngine

DOC_BEGIN = "<!-- sits bench guided: begin -->"
DOC_END = "<!-- sits bench guided: end -->"
TOOLS = [   # ToolSpec arguments
    ("get_weather", "Current weather for a city", {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}),
    ("search_flights", "Find flights between two airports", {
        "type": "object", "properties": {"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                         "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["origin", "destination", "passengers"]}),
]
QUESTIONS = ["What is the weather in Oslo?", "Find me a flight from OSL to SFO for two.",
             "Is it raining in Lima right now?", "Flights from JFK to LHR, one passenger please.",
             "How warm is it in Cairo?", "Book a trip from CDG to NRT for 3 people.",
             "Weather in Reykjavik in fahrenheit?", "Any flights from SYD to AKL for four?"]


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o["token_ids"]) for o in out)
    return {"wall_s": wall, "tokens": tokens, "ms_per_token": wall * 1e3 / max(1, tokens), "outputs": out}


def run_guided_bench(model_dir: str, *, concurrency: int = 8, rounds: int = 3, max_tokens: int = 96,
                     threads: int | None = None, json_out: str | None = None, docs_out: str | None = None) -> dict:
    from sits.engine.config import EngineConfig
    from sits.engine.llm_engine import LLMEngine
    from sits.engine.tool_format import ToolSpec, tool_call_grammar

    tools = [ToolSpec(*t) for t in TOOLS]
    engine = LLMEngine(EngineConfig(model=model_dir, device="cpu", threads=threads, kv_cache_memory_mb=256))
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                                  tools=tools)) for i in range(concurrency)]
    grammar = tool_call_grammar(tools, "required", parallel=False)
    guided = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=i, grammar=grammar) for i in range(concurrency)]
    runs: dict[str, list[dict]] = {"free": [], "guided": [], "guided+jf": []}
    _run(engine, prompts[:1], guided[:1])                      # first use: tokenizer view, grammar compile
    for r in range(rounds):
        engine.cfg.guided_jump_forward = False
        g = _run(engine, prompts, guided)
        engine.cfg.guided_jump_forward = True
        jf = _run(engine, prompts, guided)
        lengths = [len(o["token_ids"]) for o in g["outputs"]]
        free = _run(engine, prompts, [SamplingParams(max_tokens=n, temperature=0.8, seed=i, ignore_eos=True)
                                      for i, n in enumerate(lengths)])
        for name, res in (("guided", g), ("guided+jf", jf), ("free", free)):
            runs[name].append(res)
        calls_ok = sum(o["finish_reason"] == "stop" for o in jf["outputs"])
        log(f"round {r + 1}/{rounds}: free {free['ms_per_token']:.1f} ms/token, guided {g['ms_per_token']:.1f}, "
            f"guided+jf {jf['ms_per_token']:.1f} (wall {g['wall_s']:.2f} s vs {jf['wall_s']:.2f} s; "
            f"{calls_ok}/{concurrency} calls complete)")

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    result = {
        "model": model_dir, "concurrency": concurrency, "rounds": rounds, "max_tokens": max_tokens,
        "free_ms_per_token": med("free", "ms_per_token"), "guided_ms_per_token": med("guided", "ms_per_token"),
        "jf_ms_per_token": med("guided+jf", "ms_per_token"),
        "guided_wall_s": med("guided", "wall_s"), "jf_wall_s": med("guided+jf", "wall_s"),
        "free_wall_s": med("free", "wall_s"),
        "tokens_per_call": pct([r["tokens"] / concurrency for r in runs["guided"]], 0.5),
    }
    result["mask_overhead_ratio"] = result["guided_ms_per_token"] / result["free_ms_per_token"]
    result["jump_forward_speedup"] = result["guided_wall_s"] / result["jf_wall_s"]
    result["jf_vs_free_wall_ratio"] = result["jf_wall_s"] / result["free_wall_s"]
    return publish(result, "guided", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out)


def _markdown(r: dict, command: str) -> str:
    return "\n".join([
        DOC_BEGIN, "## Guided decoding: tool-call grammar and jump-forward (`sits bench guided`)", "",
        f"Command: `{command}`  ", f"Model: `{r['model']}`, {r['concurrency']} concurrent tool-call requests "
        f"(`tool_choice: required`, two functions, seeded sampling), medians of {r['rounds']} rounds, "
        f"~{r['tokens_per_call']:.0f} tokens per call.", "",
        "| mode | ms per output token | batch wall time (s) |", "|---|---|---|",
        f"| free (same token counts, no grammar) | {r['free_ms_per_token']:.2f} | {r['free_wall_s']:.2f} |",
        f"| guided, a step per token | {r['guided_ms_per_token']:.2f} | {r['guided_wall_s']:.2f} |",
        f"| guided + jump-forward | {r['jf_ms_per_token']:.2f} | {r['jf_wall_s']:.2f} |", "",
        f"- grammar mask overhead per token (guided / free): **{r['mask_overhead_ratio']:.3f}**",
        f"- jump-forward speed-up of a whole tool call (guided / guided+jf wall time): "
        f"**{r['jump_forward_speedup']:.2f}x**",
        f"- guided + jump-forward vs free generation of the same number of tokens: "
        f"**{r['jf_vs_free_wall_ratio']:.2f}**", "", DOC_END])


def _cli(args: argparse.Namespace) -> int:
    r = run_guided_bench(args.model, concurrency=args.concurrency, rounds=args.rounds, max_tokens=args.max_tokens,
                         threads=args.threads, json_out=args.json, docs_out=args.write_docs)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "guided",
                          "tool-call grammar: mask overhead vs free decoding, jump-forward on vs off", _cli,
                          threads="CPU threads")
    p.add_argument("--concurrency", type=int, default=8, help="tool-call requests run together")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each variant, median reported")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per request at most")
