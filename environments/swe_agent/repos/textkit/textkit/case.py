"""Case conversion between snake_case, camelCase and Title Case."""

SMALL_WORDS = {"a", "an", "and", "of", "the", "in", "on", "or", "to"}


def snake_to_camel(name, upper_first=False):
    """`snake_case` -> `snakeCase` (or `SnakeCase` with `upper_first`)."""
    parts = [p for p in name.split("_") if p]
    if not parts:
        return ""
    head = parts[0].capitalize() if upper_first else parts[0].lower()
    return head + "".join(p.capitalize() for p in parts[1:])


def camel_to_snake(name):
    """`camelCase` or `CamelCase` -> `camel_case`; runs of capitals stay together (`HTTPServer` ->
    `http_server`)."""
    out = []
    for i, ch in enumerate(name):
        if ch.isupper():
            previous_lower = i > 0 and name[i - 1].islower()
            next_lower = i + 1 < len(name) and name[i + 1].islower()
            starts_word = previous_lower or (next_lower and i > 0 and name[i - 1].isupper())
            if out and starts_word:
                out.append("_")
            out.append(ch.lower())
        else:
            out.append(ch)
    return "".join(out)


def title_case(text):
    """Each word capitalised, except small words that are not the first or last word."""
    words = text.split()
    result = []
    for i, word in enumerate(words):
        lower = word.lower()
        if 0 < i < len(words) - 1 and lower in SMALL_WORDS:
            result.append(lower)
        else:
            result.append(lower[:1].upper() + lower[1:])
    return " ".join(result)
