import unittest

from ledger.money import format_cents, parse_amount, percent_of, round_half_up


class TestRounding(unittest.TestCase):
    def test_half_up(self):
        self.assertEqual(round_half_up(5, 2), 3)
        self.assertEqual(round_half_up(7, 4), 2)
        self.assertEqual(round_half_up(5, 4), 1)

    def test_negative_halves_away_from_zero(self):
        self.assertEqual(round_half_up(-5, 2), -3)

    def test_bad_denominator(self):
        with self.assertRaises(ValueError):
            round_half_up(1, 0)

    def test_percent_of(self):
        self.assertEqual(percent_of(1999, 20), 400)
        self.assertEqual(percent_of(1000, 0), 0)


class TestFormatting(unittest.TestCase):
    def test_format(self):
        self.assertEqual(format_cents(1234567), "$12,345.67")
        self.assertEqual(format_cents(5), "$0.05")

    def test_negative(self):
        self.assertEqual(format_cents(-250), "-$2.50")

    def test_symbol(self):
        self.assertEqual(format_cents(100, symbol="EUR "), "EUR 1.00")

    def test_parse(self):
        self.assertEqual(parse_amount("$1,234.56"), 123456)
        self.assertEqual(parse_amount("12.5"), 1250)
        self.assertEqual(parse_amount("7"), 700)

    def test_parse_rejects(self):
        with self.assertRaises(ValueError):
            parse_amount("1.234")
        with self.assertRaises(ValueError):
            parse_amount("  ")
