"""The ``calculator`` tool of the multi-turn math environment: safe arithmetic on model text.

    >>> calculate("(3 + 4) * 2^3 / 5")
    '11.2'
    >>> calculate("1/3")
    '1/3 (about 0.333333333333)'
    >>> calculate("__import__(os)")
    'error: unsupported expression: function call'

Characters outside digits, letters, ``+ - * / ( ) . ,`` and spaces are refused; the rest is parsed
with `ast` and walked over a whitelist — numbers, ``+ - * / **``, parentheses, unary signs and
``sqrt(...)``; nothing is ever passed to ``eval``. Arithmetic is exact
(`fractions.Fraction`) until a ``sqrt`` of a non-square or a fractional power makes it a float.
``^`` means power, and ``×``, ``÷``, ``−`` and thousands separators (``1,000``) are accepted
because models write them. Limits: ``MAX_EXPRESSION_CHARS`` characters, ``MAX_NESTING`` levels of
parentheses, ``MAX_NODES`` syntax nodes, ``|exponent| <= MAX_EXPONENT``, and no value (or
numerator/denominator) beyond ``MAX_DIGITS`` digits; powers are checked *before* they are computed.
Every failure is a short string starting with ``error:`` that the model can read; `calculate`
never raises.
"""

from __future__ import annotations

import ast
import json
import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Any

__all__ = [
    "CALCULATOR_TOOL",
    "MAX_DIGITS",
    "MAX_EXPONENT",
    "MAX_EXPRESSION_CHARS",
    "calculate",
    "run_calculator_tool",
]

MAX_EXPRESSION_CHARS = 500
MAX_NESTING = 40
MAX_NODES = 300
MAX_EXPONENT = 1000
MAX_DIGITS = 100  # no result beyond 10**100 (and no fraction with a longer numerator/denominator)

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": (
            "Evaluate an arithmetic expression exactly. Supports + - * / ** (or ^), parentheses, "
            "decimals, negative numbers and sqrt(x). Fractions stay exact: 1/3 + 1/6 gives 1/2. "
            "Returns the value, or a message starting with 'error:'."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": "The expression, e.g. '(12 + 30) * 4 / 7' or 'sqrt(144) - 2^3'.",
                }
            },
            "required": ["expression"],
            "additionalProperties": False,
        },
    },
}

Number = Fraction | float


class CalculatorError(Exception):
    """Raised inside the evaluator; its message becomes ``"error: <message>"``."""


_REPLACEMENTS = {"×": "*", "÷": "/", "−": "-", "^": "**", "√": "sqrt"}
_THOUSANDS = re.compile(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d,])")
_LIMIT = Fraction(10) ** MAX_DIGITS
# Anything else (quotes, brackets, backslashes, ...) is refused before parsing: no string literals,
# no containers, and no SyntaxWarnings about escape sequences in model text.
_ALLOWED_CHARS = frozenset("0123456789+-*/()., \t\n_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _check_size(value: Number) -> Number:
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value) or abs(value) >= 10.0**MAX_DIGITS:
            raise CalculatorError("result too large")
        return value
    if abs(value) >= _LIMIT or value.denominator >= _LIMIT:
        raise CalculatorError("result too large" if abs(value) >= _LIMIT else "result too precise")
    return value


def _sqrt(x: Number) -> Number:
    if x < 0:
        raise CalculatorError("square root of a negative number")
    if isinstance(x, Fraction):
        num, den = math.isqrt(x.numerator), math.isqrt(x.denominator)
        if num * num == x.numerator and den * den == x.denominator:
            return Fraction(num, den)
    return math.sqrt(x)


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent too large (limit {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if base != 0 and abs(base) != 1:
        # log10 of the result's size, estimated before computing it
        magnitude = float(exponent) * math.log10(abs(float(base))) if float(base) != 0 else 0.0
        if magnitude > MAX_DIGITS:
            raise CalculatorError("result too large")
        if isinstance(base, Fraction) and base.denominator > 1:
            den_digits = float(abs(exponent)) * math.log10(base.denominator)
            if den_digits > MAX_DIGITS:
                raise CalculatorError("result too precise")
    integral = exponent.denominator == 1 if isinstance(exponent, Fraction) else exponent.is_integer()
    if integral:
        return base ** int(exponent) if isinstance(base, Fraction) else float(base) ** int(exponent)
    if base < 0:
        raise CalculatorError("fractional power of a negative number")
    return float(base) ** float(exponent)


_BINARY = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.Pow: _power,
}


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"unsupported value {node.value!r}")
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalculatorError("result too large")
        # Through the literal's digits, not the float: 0.1 is exactly 1/10.
        value = Fraction(Decimal(repr(node.value))) if isinstance(node.value, float) else Fraction(node.value)
        return _check_size(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalculatorError("division by zero")
        if isinstance(left, float) or isinstance(right, float):
            if not isinstance(node.op, ast.Pow):
                left, right = float(left), float(right)
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp):
        symbol = {ast.Mod: "%", ast.FloorDiv: "//", ast.BitXor: "^", ast.MatMult: "@"}.get(
            type(node.op), "this"
        )
        raise CalculatorError(f"operator {symbol} is not supported")
    if isinstance(node, ast.Call):
        if (
            isinstance(node.func, ast.Name)
            and node.func.id == "sqrt"
            and len(node.args) == 1
            and not node.keywords
        ):
            return _check_size(_sqrt(_evaluate(node.args[0])))
        raise CalculatorError("unsupported expression: function call")
    if isinstance(node, ast.Name):
        raise CalculatorError(f"unknown name {node.id!r}")
    raise CalculatorError(f"unsupported expression: {type(node).__name__}")


def _format(value: Number) -> str:
    if isinstance(value, float):
        return "0" if value == 0 else f"{value:.12g}"
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:  # a terminating decimal: show it exactly
        text = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
        if len(text) <= 30:
            return text
    return f"{value.numerator}/{value.denominator} (about {float(value):.12g})"


def calculate(expression: str) -> str:
    """The value of ``expression`` as text, or ``"error: ..."``. Never raises."""
    if not isinstance(expression, str):
        return "error: the expression must be a string"
    text = expression.strip()
    if not text:
        return "error: empty expression"
    if len(text) > MAX_EXPRESSION_CHARS:
        return f"error: expression too long (limit {MAX_EXPRESSION_CHARS} characters)"
    if "%" in text:
        return "error: '%' is not supported (write 20% as 0.2 or 20/100)"
    for old, new in _REPLACEMENTS.items():
        text = text.replace(old, new)
    text = _THOUSANDS.sub(lambda m: m.group(0).replace(",", ""), text)
    if bad := next((ch for ch in text if ch not in _ALLOWED_CHARS), None):
        return f"error: unexpected character {bad!r}"
    depth = 0
    for ch in text:  # before ast.parse, whose own recursion is what deep nesting attacks
        depth += (ch == "(") - (ch == ")")
        if depth > MAX_NESTING:
            return f"error: too many nested parentheses (limit {MAX_NESTING})"
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "error: could not parse the expression"
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        return "error: expression too long"
    try:
        return _format(_evaluate(tree))
    except CalculatorError as e:
        return f"error: {e}"
    except ZeroDivisionError:
        return "error: division by zero"
    except (OverflowError, ValueError, RecursionError, MemoryError):
        return "error: result too large"


def run_calculator_tool(arguments: str | dict[str, Any]) -> str:
    """Answer a ``calculator`` tool call: ``arguments`` is the call's JSON text (as the model wrote
    it, possibly malformed) or an already-decoded dict. Never raises."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return 'error: arguments must be JSON like {"expression": "2 + 2"}'
    if not isinstance(arguments, dict) or not isinstance(arguments.get("expression"), str):
        return 'error: arguments must be JSON like {"expression": "2 + 2"}'
    return calculate(arguments["expression"])
