"""Amounts are integers of cents; these helpers round and format them."""


def round_half_up(numerator, denominator):
    """numerator / denominator rounded to the nearest integer, halves away from zero."""
    if denominator <= 0:
        raise ValueError("denominator must be positive")
    sign = -1 if numerator < 0 else 1
    q, r = divmod(abs(numerator), denominator)
    if 2 * r >= denominator:
        q += 1
    return sign * q


def percent_of(cents, percent):
    """`percent` percent of `cents`, rounded half up."""
    return round_half_up(cents * percent, 100)


def format_cents(cents, symbol="$"):
    """1234567 -> '$12,345.67'; negative amounts get a leading minus."""
    sign = "-" if cents < 0 else ""
    whole, frac = divmod(abs(cents), 100)
    return f"{sign}{symbol}{whole:,}.{frac:02d}"


def parse_amount(text):
    """'12.5' or '$1,234.56' -> cents."""
    cleaned = text.strip().lstrip("$").replace(",", "")
    if not cleaned:
        raise ValueError("empty amount")
    if "." in cleaned:
        whole, frac = cleaned.split(".", 1)
        if len(frac) > 2:
            raise ValueError("more than two decimals")
        frac = frac.ljust(2, "0")
    else:
        whole, frac = cleaned, "00"
    return int(whole or "0") * 100 + int(frac)
