"""Reasoning sealed into the opaque string a client keeps and sends back, so it round-trips exactly.

Vendors do not hand a client its model's reasoning in the clear: Anthropic answers a `thinking`
block with a `signature` (and with `display: "omitted"` an empty text beside it), the Responses API
a `reasoning` item with `encrypted_content` (`include: ["reasoning.encrypted_content"]`, what Codex
asks for with `store: false`). Clients keep that string and send it back on the next turn, and the
vendor restores the reasoning from it. The gateway does the same with its own reasoning text: `seal`
makes the string (the text, compressed and base64-encoded behind a version prefix; not secret, it is
the client's own model output), `unseal` reads it back, so the next turn's history holds exactly the
reasoning the model produced and bridges onto its tokens. A string the gateway did not make
unseals to None (the client's own text is then used).
"""

from __future__ import annotations

import base64
import binascii
import zlib

__all__ = ["MAX_SEALED_CHARS", "PREFIX", "seal", "unseal"]

PREFIX = "palaestra-r1:"
MAX_SEALED_CHARS = 16 << 20
"""Longest reasoning `unseal` restores (a compressed string cannot expand past it: no zip bomb)."""


def seal(text: str) -> str:
    return PREFIX + base64.b64encode(zlib.compress(text.encode("utf-8"), 6)).decode("ascii")


def unseal(sealed: object) -> str | None:
    """The reasoning sealed in `sealed`, or None when it is not a string `seal` made."""
    if not isinstance(sealed, str) or not sealed.startswith(PREFIX):
        return None
    try:
        raw = base64.b64decode(sealed[len(PREFIX) :], validate=True)
        inflater = zlib.decompressobj()
        data = inflater.decompress(raw, MAX_SEALED_CHARS * 4)
        if inflater.unconsumed_tail or not inflater.eof:
            return None
        return data.decode("utf-8")
    except (binascii.Error, zlib.error, UnicodeDecodeError, ValueError):
        return None
