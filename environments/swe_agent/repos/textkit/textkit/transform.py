"""Turning text into other text: slugs, truncation, wrapping, padding."""


def slugify(text, separator="-", max_length=50):
    """Lowercase ASCII words of `text` joined by `separator`, at most `max_length` characters."""
    words = []
    current = ""
    for ch in text.lower():
        if ch.isascii() and ch.isalnum():
            current += ch
        elif current:
            words.append(current)
            current = ""
    if current:
        words.append(current)
    slug = separator.join(words)
    if len(slug) > max_length:
        slug = slug[:max_length].rstrip(separator)
    return slug


def truncate(text, limit, ellipsis="..."):
    """`text` cut to at most `limit` characters, ending in `ellipsis` when it was cut."""
    if limit < len(ellipsis):
        raise ValueError("limit is shorter than the ellipsis")
    if len(text) <= limit:
        return text
    return text[: limit - len(ellipsis)] + ellipsis


def wrap(text, width=20):
    """Greedy word wrap: lines of at most `width` characters (a longer word gets its own line)."""
    if width < 1:
        raise ValueError("width must be positive")
    lines = []
    line = ""
    for word in text.split():
        if not line:
            line = word
        elif len(line) + 1 + len(word) <= width:
            line = line + " " + word
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def pad_left(text, width, fill=" "):
    """`text` right-aligned in `width` characters, padded with `fill` on the left."""
    if len(fill) != 1:
        raise ValueError("fill must be one character")
    missing = width - len(text)
    if missing <= 0:
        return text
    return fill * missing + text


def collapse_spaces(text):
    """Runs of whitespace replaced by one space, ends stripped."""
    return " ".join(text.split())
