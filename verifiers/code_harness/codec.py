"""Values that cross between the grader and the solution's process, as tagged JSON.

Only plain data crosses: None, bool, int, float, complex, str, bytes, list, tuple, dict, set and
frozenset, nested. Decoding builds fresh builtin objects, so nothing the solution returns can carry
behaviour into the grader (an `int` subclass whose `__eq__` always answers True arrives as an int).
Runs inside the sandbox; standard library only.
"""

import json
import sys

if hasattr(sys, "set_int_max_str_digits"):
    sys.set_int_max_str_digits(0)

MAX_DEPTH = 200


def encode(value, depth=0):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply to pass between the tests and the solution")
    if value is None or type(value) is bool or type(value) is str:
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return {"i": int.__repr__(int(value))}
    if isinstance(value, float):
        return {"f": float.__repr__(float(value))}
    if isinstance(value, complex):
        return {"c": [float.__repr__(value.real), float.__repr__(value.imag)]}
    if isinstance(value, str):
        return {"s": "".join(value)}
    if isinstance(value, (bytes, bytearray)):
        return {"y": bytes(value).hex()}
    items = None
    if isinstance(value, tuple):
        tag, items = "t", value
    elif isinstance(value, list):
        tag, items = "l", value
    elif isinstance(value, frozenset):
        tag, items = "F", value
    elif isinstance(value, set):
        tag, items = "S", value
    if items is not None:
        return {tag: [encode(v, depth + 1) for v in items]}
    if isinstance(value, dict):
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}
    raise TypeError(f"a {type(value).__name__} cannot be passed between the tests and the solution")


def decode(data, depth=0):
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply")
    if data is None or type(data) is bool or type(data) is str:
        return data
    if type(data) is not dict or len(data) != 1:
        raise ValueError("malformed value from the solution's process")
    ((tag, body),) = data.items()
    if tag == "i" and type(body) is str:
        return int(body)
    if tag == "f" and type(body) is str:
        return float(body)
    if tag == "c" and type(body) is list and len(body) == 2:
        return complex(float(body[0]), float(body[1]))
    if tag == "s" and type(body) is str:
        return body
    if tag == "y" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError("malformed value from the solution's process")
    if tag == "d":
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError("malformed dict from the solution's process")
            out[decode(pair[0], depth + 1)] = decode(pair[1], depth + 1)
        return out
    items = [decode(v, depth + 1) for v in body]
    if tag == "l":
        return items
    if tag == "t":
        return tuple(items)
    if tag == "S":
        return set(items)
    if tag == "F":
        return frozenset(items)
    raise ValueError("malformed value from the solution's process")


def dumps(message):
    return json.dumps(message, separators=(",", ":")) + "\n"
