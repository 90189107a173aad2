"""Scale triggers: a small, safe expression language over a unit's windowed metrics.

    ttft_p95 > 800ms || kv_util > 85%
    !(queue_depth == 0) && slo_health < 0.75

Grammar (``||`` binds looser than ``&&``, ``!`` tightest; parentheses group)::

    expr       := and ("||" and)*
    and        := unary ("&&" unary)*
    unary      := "!" unary | "(" expr ")" | comparison
    comparison := operand ("<" | "<=" | ">" | ">=" | "==" | "!=") operand
    operand    := METRIC | NUMBER [ "ms" | "s" | "%" ]

It is parsed by hand into a tree (never ``eval``) and checked for units: a time metric compares with
``ms`` or ``s``, a ratio metric with ``%`` or a plain fraction, a count with a plain number. Every
error is a ``TriggerError`` that names the column and shows it. A metric with no data yet (no
traffic, or ``gpu_util`` on a host without a GPU) makes its comparison false.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from sits.engine.errors import SitsError

TIME, RATIO, COUNT = "time", "ratio", "count"

# metric -> kind; times are compared in milliseconds, ratios as fractions (85% == 0.85)
METRICS: dict[str, str] = {
    "ttft_p95": TIME, "itl_p95": TIME, "latency_p95": TIME,
    "queue_depth": COUNT, "rps": COUNT,
    "kv_util": RATIO, "cpu_util": RATIO, "gpu_util": RATIO, "slo_health": RATIO,
}

_CMP: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
}
_TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<num>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)(?P<unit>ms|s|%)?(?![A-Za-z_0-9])
  | (?P<name>[A-Za-z_][A-Za-z_0-9]*)
  | (?P<op>\|\||&&|<=|>=|==|!=|<|>|!|\(|\))
""", re.VERBOSE)
MAX_LENGTH = 1000


class TriggerError(SitsError):
    code = "invalid_trigger"
    http_status = 400

    def __init__(self, message: str, source: str, column: int):
        self.column = column             # 1-based
        self.source = source
        caret = f"\n  {source}\n  {' ' * (column - 1)}^"
        super().__init__(f"trigger, column {column}: {message}{caret}", param="scale.trigger")


# -- the tree -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Metric:
    name: str


@dataclass(frozen=True, slots=True)
class Number:
    value: float            # normalised: ms for times, fraction for ratios
    unit: str | None


@dataclass(frozen=True, slots=True)
class Compare:
    op: str
    left: Metric | Number
    right: Metric | Number


@dataclass(frozen=True, slots=True)
class Not:
    arg: "Node"


@dataclass(frozen=True, slots=True)
class And:
    args: tuple["Node", ...]


@dataclass(frozen=True, slots=True)
class Or:
    args: tuple["Node", ...]


Node = Compare | Not | And | Or


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str           # "num" | "name" | "op" | "end"
    text: str
    col: int            # 1-based
    unit: str | None = None


def _lex(src: str) -> list[_Tok]:
    out, pos = [], 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if m is None:
            if src[pos].isdigit() or src[pos] == ".":
                raise TriggerError("a number with an unknown unit: use ms, s or %", src, pos + 1)
            raise TriggerError(f"unexpected character {src[pos]!r}", src, pos + 1)
        if m.lastgroup != "ws":
            kind = "num" if m.group("num") is not None else m.lastgroup
            text = m.group("num") if kind == "num" else m.group(0)
            out.append(_Tok(kind, text, pos + 1, m.group("unit") if kind == "num" else None))
        pos = m.end()
    out.append(_Tok("end", "", len(src) + 1))
    return out


class _Parser:
    def __init__(self, src: str):
        self.src = src
        self.toks = _lex(src)
        self.i = 0

    def peek(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def fail(self, tok: _Tok, what: str) -> TriggerError:
        found = "the end" if tok.kind == "end" else repr(tok.text)
        return TriggerError(f"expected {what}, found {found}", self.src, tok.col)

    def parse(self) -> Node:
        node = self.or_()
        if self.peek().kind != "end":
            raise self.fail(self.peek(), "'&&', '||' or the end")
        return node

    def or_(self) -> Node:
        args = [self.and_()]
        while self.peek().text == "||":
            self.take()
            args.append(self.and_())
        return args[0] if len(args) == 1 else Or(tuple(args))

    def and_(self) -> Node:
        args = [self.unary()]
        while self.peek().text == "&&":
            self.take()
            args.append(self.unary())
        return args[0] if len(args) == 1 else And(tuple(args))

    def unary(self) -> Node:
        t = self.peek()
        if t.text == "!":
            self.take()
            return Not(self.unary())
        if t.text == "(":
            self.take()
            node = self.or_()
            if self.peek().text != ")":
                raise self.fail(self.peek(), "')'")
            self.take()
            return node
        return self.comparison()

    def comparison(self) -> Compare:
        left, lt = self.operand()
        op = self.peek()
        if op.text not in _CMP:
            raise self.fail(op, "a comparison (<, <=, >, >=, ==, !=)")
        self.take()
        right, rt = self.operand()
        if isinstance(left, Number) and isinstance(right, Number):
            raise TriggerError("a comparison needs a metric on one side", self.src, lt.col)
        if isinstance(left, Metric) and isinstance(right, Metric):
            if METRICS[left.name] != METRICS[right.name]:
                raise TriggerError(f"{left.name} ({METRICS[left.name]}) and {right.name} ({METRICS[right.name]}) "
                                   "cannot be compared", self.src, rt.col)
        else:
            metric, number, ntok = (left, right, rt) if isinstance(left, Metric) else (right, left, lt)
            number = self.check_unit(metric, number, ntok)
            left, right = (metric, number) if isinstance(left, Metric) else (number, metric)
        return Compare(op.text, left, right)

    def operand(self) -> tuple[Metric | Number, _Tok]:
        t = self.take()
        if t.kind == "name":
            if t.text not in METRICS:
                raise TriggerError(f"unknown metric {t.text!r}; known: {', '.join(METRICS)}", self.src, t.col)
            return Metric(t.text), t
        if t.kind == "num":
            value = float(t.text)
            if not math.isfinite(value):
                raise TriggerError(f"{t.text} is not a finite number", self.src, t.col)
            return Number(value, t.unit), t
        raise self.fail(t, "a metric or a number")

    def check_unit(self, metric: Metric, num: Number, tok: _Tok) -> Number:
        kind = METRICS[metric.name]
        if kind == TIME:
            if num.unit == "ms":
                return Number(num.value, "ms")
            if num.unit == "s":
                return Number(num.value * 1000.0, "ms")
            raise TriggerError(f"{metric.name} is a time: write the number with ms or s (e.g. 800ms)",
                               self.src, tok.col)
        if kind == RATIO:
            if num.unit == "%":
                return Number(num.value / 100.0, None)
            if num.unit is None:
                return num
            raise TriggerError(f"{metric.name} is a ratio: write a percentage (85%) or a fraction (0.85)",
                               self.src, tok.col)
        if num.unit is not None:
            raise TriggerError(f"{metric.name} is a count: write a plain number, without {num.unit}",
                               self.src, tok.col)
        return num


@dataclass(frozen=True, slots=True)
class Trigger:
    source: str
    tree: Node

    def evaluate(self, metrics: Mapping[str, float | None]) -> bool:
        """True when the expression holds for ``metrics`` (times in ms, ratios as fractions)."""
        return _eval(self.tree, metrics)

    def metrics(self) -> set[str]:
        return _names(self.tree)


def parse_trigger(source: str) -> Trigger:
    """Parse and check a trigger; raises TriggerError (and nothing else) for any bad input."""
    if not isinstance(source, str):
        raise TriggerError("a trigger is a string", str(source), 1)
    if len(source) > MAX_LENGTH:
        raise TriggerError(f"a trigger is at most {MAX_LENGTH} characters", source[:40] + "...", 1)
    if not source.strip():
        raise TriggerError("the trigger is empty", source, 1)
    try:
        return Trigger(source, _Parser(source).parse())
    except RecursionError:
        raise TriggerError("the expression nests too deeply", source, 1) from None


def _value(x: Metric | Number, metrics: Mapping[str, float | None]) -> float | None:
    if isinstance(x, Number):
        return x.value
    v = metrics.get(x.name)
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _eval(node: Node, metrics: Mapping[str, float | None]) -> bool:
    if isinstance(node, Compare):
        a, b = _value(node.left, metrics), _value(node.right, metrics)
        return a is not None and b is not None and _CMP[node.op](a, b)
    if isinstance(node, Not):
        return not _eval(node.arg, metrics)
    if isinstance(node, And):
        return all(_eval(a, metrics) for a in node.args)
    return any(_eval(a, metrics) for a in node.args)


def _names(node: Node) -> set[str]:
    if isinstance(node, Compare):
        return {x.name for x in (node.left, node.right) if isinstance(x, Metric)}
    if isinstance(node, Not):
        return _names(node.arg)
    return set().union(*(_names(a) for a in node.args))
