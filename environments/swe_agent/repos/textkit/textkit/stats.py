"""Counting words and characters."""


def words_of(text):
    """Lowercased words, punctuation at their ends removed."""
    out = []
    for raw in text.split():
        word = raw.strip(".,;:!?\"'()").lower()
        if word:
            out.append(word)
    return out


def word_count(text):
    return len(words_of(text))


def most_common_words(text, n=3, min_length=1):
    """The `n` most common words of at least `min_length` characters, as (word, count), most common
    first, ties in order of first appearance."""
    counts = {}
    order = []
    for word in words_of(text):
        if len(word) < min_length:
            continue
        if word not in counts:
            counts[word] = 0
            order.append(word)
        counts[word] += 1
    ranked = sorted(order, key=lambda w: (-counts[w], order.index(w)))
    return [(w, counts[w]) for w in ranked[:n]]


def char_histogram(text, ignore_spaces=True):
    """How often each character occurs, as a dict sorted by character."""
    counts = {}
    for ch in text:
        if ignore_spaces and ch.isspace():
            continue
        counts[ch] = counts.get(ch, 0) + 1
    return dict(sorted(counts.items()))


def average_word_length(text):
    words = words_of(text)
    if not words:
        return 0.0
    return sum(len(w) for w in words) / len(words)
