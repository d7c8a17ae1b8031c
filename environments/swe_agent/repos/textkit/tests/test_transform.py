import unittest

from textkit.transform import collapse_spaces, pad_left, slugify, truncate, wrap


class TestSlugify(unittest.TestCase):
    def test_words_joined_by_hyphens(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")

    def test_custom_separator(self):
        self.assertEqual(slugify("a b c", separator="_"), "a_b_c")

    def test_non_ascii_dropped(self):
        self.assertEqual(slugify("Café au lait"), "caf-au-lait")

    def test_max_length(self):
        self.assertEqual(slugify("one two three", max_length=7), "one-two")
        self.assertEqual(slugify("abcdef", max_length=6), "abcdef")

    def test_default_max_length_is_50(self):
        self.assertEqual(len(slugify("x" * 80)), 50)


class TestTruncate(unittest.TestCase):
    def test_short_text_unchanged(self):
        self.assertEqual(truncate("hello", 5), "hello")

    def test_cut_with_ellipsis(self):
        self.assertEqual(truncate("hello world", 8), "hello...")

    def test_custom_ellipsis(self):
        self.assertEqual(truncate("abcdefgh", 4, ellipsis="~"), "abc~")

    def test_limit_too_small(self):
        with self.assertRaises(ValueError):
            truncate("hello", 2)


class TestWrap(unittest.TestCase):
    def test_greedy(self):
        self.assertEqual(wrap("the quick brown fox", width=9), ["the quick", "brown fox"])

    def test_exact_width_fits(self):
        self.assertEqual(wrap("ab cd", width=5), ["ab cd"])

    def test_long_word_alone(self):
        self.assertEqual(wrap("a verylongword b", width=4), ["a", "verylongword", "b"])

    def test_default_width(self):
        self.assertEqual(wrap("aaaa " * 5), ["aaaa aaaa aaaa aaaa", "aaaa"])

    def test_empty(self):
        self.assertEqual(wrap(""), [])


class TestPad(unittest.TestCase):
    def test_pad(self):
        self.assertEqual(pad_left("7", 3, "0"), "007")

    def test_no_pad_needed(self):
        self.assertEqual(pad_left("1234", 3), "1234")
        self.assertEqual(pad_left("123", 3), "123")

    def test_default_fill_is_space(self):
        self.assertEqual(pad_left("x", 2), " x")

    def test_collapse(self):
        self.assertEqual(collapse_spaces("  a \t b\n c "), "a b c")
