import unittest

from textkit.stats import average_word_length, char_histogram, most_common_words, word_count


class TestCounts(unittest.TestCase):
    def test_word_count_ignores_punctuation(self):
        self.assertEqual(word_count("Hello, world! -- ok"), 4)

    def test_most_common(self):
        text = "b a b c a b d"
        self.assertEqual(most_common_words(text, n=2), [("b", 3), ("a", 2)])

    def test_most_common_ties_in_first_appearance_order(self):
        self.assertEqual(most_common_words("x y y x z", n=3), [("x", 2), ("y", 2), ("z", 1)])

    def test_most_common_default_n(self):
        self.assertEqual(len(most_common_words("a b c d e")), 3)

    def test_min_length(self):
        self.assertEqual(most_common_words("an ox an apple", n=5, min_length=3), [("apple", 1)])

    def test_histogram(self):
        self.assertEqual(char_histogram("b a b"), {"a": 1, "b": 2})
        self.assertEqual(char_histogram("a a", ignore_spaces=False), {" ": 1, "a": 2})

    def test_average_word_length(self):
        self.assertEqual(average_word_length("ab abcd"), 3.0)
        self.assertEqual(average_word_length(""), 0.0)
