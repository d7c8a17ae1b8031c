"""textkit: small text utilities."""

from textkit.case import camel_to_snake, snake_to_camel, title_case
from textkit.stats import char_histogram, most_common_words, word_count
from textkit.transform import pad_left, slugify, truncate, wrap

__all__ = [
    "camel_to_snake",
    "char_histogram",
    "most_common_words",
    "pad_left",
    "slugify",
    "snake_to_camel",
    "title_case",
    "truncate",
    "word_count",
    "wrap",
]
