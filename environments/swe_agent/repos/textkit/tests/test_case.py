import unittest

from textkit.case import camel_to_snake, snake_to_camel, title_case


class TestSnakeToCamel(unittest.TestCase):
    def test_lower_first(self):
        self.assertEqual(snake_to_camel("user_name_id"), "userNameId")

    def test_upper_first(self):
        self.assertEqual(snake_to_camel("user_name", upper_first=True), "UserName")

    def test_extra_underscores(self):
        self.assertEqual(snake_to_camel("__a__b"), "aB")

    def test_empty(self):
        self.assertEqual(snake_to_camel("___"), "")


class TestCamelToSnake(unittest.TestCase):
    def test_camel(self):
        self.assertEqual(camel_to_snake("userNameId"), "user_name_id")

    def test_pascal(self):
        self.assertEqual(camel_to_snake("UserName"), "user_name")

    def test_acronym(self):
        self.assertEqual(camel_to_snake("HTTPServer"), "http_server")


class TestTitleCase(unittest.TestCase):
    def test_small_words(self):
        self.assertEqual(title_case("the lord of the rings"), "The Lord of the Rings")

    def test_last_word_capitalised(self):
        self.assertEqual(title_case("what it is made of"), "What It Is Made Of")

    def test_mixed_case_input(self):
        self.assertEqual(title_case("hELLO wORLD"), "Hello World")
