"""Tools for multi-turn episodes: a safe calculator, Hermes-style tool-call parsing, and a runner
that bounds every call in time and counts what went wrong.

The data types are torchrl's (``ToolCall``, the ``ToolService`` protocol: a callable with a
``name`` that takes keyword arguments and returns a dict, and ``ToolRegistry``), so torchrl's
services (e.g. its ``PythonExecutorService``) plug in unchanged. torchrl's own executor
(``ExecuteToolsInOrder``) is not used: it calls the services one after another with no time limit,
so one hanging tool would stall the rollout worker; :class:`ToolRunner` runs calls concurrently in
a thread pool, waits at most ``timeout_s`` per call and turns a hang or an exception into an error
message for the model and a counter for the monitor. torchrl ships parsers for its XML
(``<tool name=...>``) and JSON formats but not for the ``<tool_call>{"name", "arguments"}
</tool_call>`` blocks that Qwen/Hermes chat templates teach models, hence :class:`HermesToolParser`.
"""
from __future__ import annotations

import ast
import json
import operator
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from torchrl.envs.llm.transforms.tools import ParseResult, ToolCall, ToolRegistry

__all__ = ["Calculator", "CalculatorError", "HermesToolParser", "ToolCall", "ToolRegistry", "ToolResult",
           "ToolRunner", "evaluate_arithmetic"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 256
MAX_RESULT_DIGITS = 1000  # products of 256-char expressions stay far below; bounds the work anyway


class CalculatorError(ValueError):
    """The expression is not plain arithmetic on numbers, or cannot be evaluated."""


def evaluate_arithmetic(expression: str) -> int | float:
    """Evaluate ``+ - * / // %`` and parentheses over int/float literals; nothing else.

    The expression is parsed with :mod:`ast` and only number literals, those binary operators
    and unary +/- are walked: no names, calls, attributes, powers or comprehensions, so no code
    runs. Raises :class:`CalculatorError` naming what was refused.

    Examples:
        >>> evaluate_arithmetic("(12 + 3) * 4 // 7")
        8
        >>> evaluate_arithmetic("__import__('os')")
        Traceback (most recent call last):
        ...
        streamrl.envs.tools.CalculatorError: not allowed in arithmetic: Call
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression has {len(expression)} characters, at most {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from e
    return _eval(tree.body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        try:
            value = _BINARY[type(node.op)](left, right)
        except ZeroDivisionError as e:
            raise CalculatorError("division by zero") from e
        if isinstance(value, int) and value.bit_length() > MAX_RESULT_DIGITS * 3.33:
            raise CalculatorError(f"result exceeds {MAX_RESULT_DIGITS} digits")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    raise CalculatorError(f"not allowed in arithmetic: {type(node).__name__}")


class Calculator:
    """A torchrl ``ToolService``: ``calculator(expression="12*34") -> {"result": "408"}``."""

    name = "calculator"
    schema_in = {"expression": str}
    schema_out = {"result": str}
    description = "Evaluate an arithmetic expression with + - * / // % and parentheses."

    def __call__(self, expression: str, **_: Any) -> dict[str, str]:
        value = evaluate_arithmetic(expression)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return {"result": str(value)}


class HermesToolParser:
    """Parse ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen/Hermes).

    A torchrl ``LLMToolParser``: returns a ``ParseResult`` with the text outside the blocks and
    the calls in order. A block that is not valid JSON or lacks ``name`` becomes a call of the
    tool ``"<invalid>"`` carrying the raw text, so the runner reports it to the model and counts
    it as an error instead of silently ignoring the attempt.

    Examples:
        >>> r = HermesToolParser()('ok <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>')
        >>> r["calls"][0].tool, r["calls"][0].args, r["text"]
        ('calculator', {'expression': '1+2'}, 'ok')
    """

    INVALID = "<invalid>"
    _block = re.compile(r"<tool_call>\s*(?P<body>.*?)\s*</tool_call>", re.DOTALL)

    def __call__(self, response: str | dict[str, Any]) -> ParseResult:
        text = response if isinstance(response, str) else response.get("text", "")
        calls: list[ToolCall] = []
        for m in self._block.finditer(text):
            calls.append(self._call(m.group("body")))
        result = ParseResult()
        result["text"] = self._block.sub("", text).strip()
        result["calls"] = calls
        result["meta"] = {"count": len(calls)}
        return result

    def _call(self, body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return ToolCall(tool=self.INVALID, args={"raw": body})
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall(tool=self.INVALID, args={"raw": body})
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some templates emit the arguments JSON-encoded once more
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return ToolCall(tool=self.INVALID, args={"raw": body})
        if not isinstance(args, dict):
            return ToolCall(tool=self.INVALID, args={"raw": body})
        return ToolCall(tool=obj["name"], args=args)


@dataclass
class ToolResult:
    """Outcome of one call: ``content`` is what the model reads back.

    status: "ok", "error" (raised, unknown tool, bad call) or "timeout".
    latency_s: wall time from submission until the result (or the time limit).
    output: the service's dict when ``status == "ok"`` (``content`` is its JSON), else None.
    """

    tool: str
    content: str
    status: str
    latency_s: float
    output: dict | None = None


class ToolRunner:
    """Run tool calls concurrently in a thread pool, each bounded by ``timeout_s``.

    A call that raises becomes an ``error`` result; one that does not finish in time becomes a
    ``timeout`` result and the caller moves on (a Python thread cannot be killed: the hung call
    keeps its pool thread until it returns, which is why the pool is sized above the expected
    concurrency and ``hung`` is reported -- tools that can hang for good belong in a process, as
    torchrl's ``PythonExecutorService`` does). Counters (``counters()``) feed the monitor.
    Thread-safe: many episodes share one runner.
    """

    def __init__(self, registry: ToolRegistry, timeout_s: float = 5.0, max_workers: int = 16):
        if timeout_s <= 0:
            raise ValueError(f"tool timeout_s = {timeout_s}: must be > 0")
        if max_workers < 1:
            raise ValueError(f"tool max_workers = {max_workers}: must be >= 1")
        self.registry, self.timeout_s = registry, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="streamrl-tool")
        self._lock = threading.Lock()
        self._counts = {"env/tool_calls_total": 0, "env/tool_errors_total": 0, "env/tool_timeouts_total": 0,
                        "env/tool_latency_s_total": 0.0}
        self._running = 0

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Run ``calls`` concurrently; results in call order, after at most ~``timeout_s``."""
        start = time.monotonic()
        futures = [self._pool.submit(self._invoke, c) for c in calls]
        deadline = start + self.timeout_s
        results = []
        for call, fut in zip(calls, futures):
            try:
                results.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                results.append(ToolResult(call.tool, f"error: {call.tool} timed out after {self.timeout_s:g} s",
                                          "timeout", time.monotonic() - start))
        with self._lock:
            for r in results:
                self._counts["env/tool_calls_total"] += 1
                self._counts["env/tool_errors_total"] += r.status == "error"
                self._counts["env/tool_timeouts_total"] += r.status == "timeout"
                self._counts["env/tool_latency_s_total"] += r.latency_s
        return results

    def _invoke(self, call: ToolCall) -> ToolResult:
        start = time.monotonic()
        with self._lock:
            self._running += 1
        try:
            if call.tool not in self.registry:
                return ToolResult(call.tool, f"error: unknown tool {call.tool!r}", "error", time.monotonic() - start)
            out = self.registry.get(call.tool)(**call.args)
            if not isinstance(out, dict):
                return ToolResult(call.tool, f"error: {call.tool} returned {type(out).__name__}, not a dict",
                                  "error", time.monotonic() - start)
            return ToolResult(call.tool, json.dumps(out), "ok", time.monotonic() - start, out)
        except Exception as e:  # any failure of a tool is the model's problem, never the worker's
            return ToolResult(call.tool, f"error: {type(e).__name__}: {e}", "error", time.monotonic() - start)
        finally:
            with self._lock:
                self._running -= 1

    def counters(self) -> dict[str, float]:
        """``env/tool_calls_total``, ``env/tool_errors_total``, ``env/tool_timeouts_total``,
        ``env/tool_latency_s_total`` since start, and ``env/tools_hung``: calls still running (past
        their time limit or in progress)."""
        with self._lock:
            return {**self._counts, "env/tools_hung": float(self._running)}

    def close(self) -> None:
        """Stop accepting calls; hung calls are abandoned, not waited for."""
        self._pool.shutdown(wait=False, cancel_futures=True)
