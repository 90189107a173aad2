"""``sits bench wire``: the encoding of the messages between a front end and an instance process.

The process boundary carries an ``EngineRequest`` per request and a ``StepOutput`` (one
``TokenEvent`` per running request) per engine step. This measures encode + decode per message and
the bytes per frame for pickle (what ``runtime/wire.py`` uses) and msgspec's MessagePack with typed
decoders (what vLLM uses), the codecs alternating within each round; the baseline is pickle.
msgspec is measured when it is installed (it is not a dependency of SITS).
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

from sits.bench.common import add_bench_command, log, publish

DOC_BEGIN = "<!-- sits bench wire: begin -->"
DOC_END = "<!-- sits bench wire: end -->"


def _messages() -> dict[str, object]:
    from sits.engine.messages import EngineRequest, EngineStats, StepOutput, TokenEvent
    from sits.engine.sampling_params import SamplingParams

    def event(i: int) -> TokenEvent:
        return TokenEvent(f"chatcmpl-{i:012d}-0", 1000 + i, " word", index=17, num_prompt_tokens=125,
                          num_output_tokens=18, arrival_time=1234.5, first_scheduled_time=1234.6,
                          first_token_time=1234.7, time=1235.0 + i)

    return {
        "EngineRequest (125-token prompt)": EngineRequest("chatcmpl-000000000001-0", list(range(1000, 1125)),
                                                          SamplingParams(max_tokens=32, temperature=0.7, seed=3)),
        "StepOutput, 1 event": StepOutput([event(0)]),
        "StepOutput, 16 events": StepOutput([event(i) for i in range(16)]),
        "StepOutput, 64 events": StepOutput([event(i) for i in range(64)]),
        "EngineStats": EngineStats(3, 16, 0.4, 1024, 600, 100, 80, 0.8, 0, 5000, "pfsd", {"phases_ms": {"weights": 12.0}}),
    }


def _time(fn, seconds: float) -> float:
    for _ in range(20):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(50):
            fn()
        n += 50
    return (time.perf_counter() - t0) / n * 1e6


def _codecs() -> dict[str, object]:
    codecs = {"pickle": None}
    try:
        import msgspec  # noqa: F401
        codecs["msgspec"] = None
    except ImportError:
        pass
    return codecs


def run_wire_bench(*, rounds: int = 5, seconds: float = 0.2, json_out: str | None = None,
                   docs_out: str | None = None) -> dict:
    messages = _messages()
    codecs = list(_codecs())
    runs: dict[str, dict[str, list[float]]] = {c: {m: [] for m in messages} for c in codecs}
    size: dict[str, dict[str, int]] = {c: {} for c in codecs}
    for r in range(rounds):
        for codec in (codecs if r % 2 == 0 else list(reversed(codecs))):
            for name, msg in messages.items():
                if codec == "pickle":
                    blob = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)

                    def roundtrip(msg=msg):
                        pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
                else:
                    import msgspec
                    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(type(msg))
                    blob = enc.encode(msg)
                    assert dec.decode(blob) == msg or name.startswith("EngineRequest")

                    def roundtrip(msg=msg, enc=enc, dec=dec):
                        dec.decode(enc.encode(msg))
                size[codec][name] = len(blob)
                runs[codec][name].append(_time(roundtrip, seconds))
        log(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{c} {runs[c]['StepOutput, 16 events'][-1]:.1f} us" for c in codecs) + " (StepOutput, 16 events)")
    median = {c: {m: statistics.median(v) for m, v in runs[c].items()} for c in codecs}
    result = {"rounds": rounds, "codecs": codecs, "messages": list(messages), "median_us": median, "bytes": size}
    return publish(result, "wire", _markdown, DOC_BEGIN, DOC_END, json_out, docs_out)


def _markdown(r: dict, command: str) -> str:
    codecs, med = r["codecs"], r["median_us"]
    head = "| message | " + " | ".join(f"{c} encode+decode µs | {c} bytes" for c in codecs)
    head += " | pickle / msgspec time |" if "msgspec" in codecs else " |"
    lines = [DOC_BEGIN, "## The process boundary's encoding (`sits bench wire`)", "", f"Command: `{command}`  ",
             f"Encode + decode of one message, in-process, medians of {r['rounds']} rounds with the codecs "
             "taking turns; msgspec = MessagePack with a typed decoder per message type. Chosen by this: "
             "`runtime/wire.py` sends the engine's messages with msgspec (pickle only for the zygote's control "
             "tuples and embeddings' arrays); the served overhead with it is in the serve benchmark's old-vs-new run.",
             "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for m in r["messages"]:
        row = f"| {m} | " + " | ".join(f"{med[c][m]:.1f} | {r['bytes'][c][m]}" for c in codecs)
        row += f" | {med['pickle'][m] / med['msgspec'][m]:.2f} |" if "msgspec" in codecs else " |"
        lines.append(row)
    lines += ["", DOC_END]
    return "\n".join(lines)


def _cli(args: argparse.Namespace) -> int:
    r = run_wire_bench(rounds=args.repeats, seconds=args.seconds, json_out=args.json, docs_out=args.write_docs)
    print(json.dumps({"median_us": r["median_us"], "bytes": r["bytes"]}, indent=2))
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    p = add_bench_command(subparsers, "wire", "the instance boundary's encoding: pickle vs msgspec, per message",
                          _cli, model=False, repeats="rounds of every codec, median reported", repeats_default=5)
    p.add_argument("--seconds", type=float, default=0.2, help="timing window per message, codec and round")
