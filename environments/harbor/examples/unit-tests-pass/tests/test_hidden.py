import sys
import unittest

sys.path.insert(0, "/app")
from textkit import slugify


class HiddenTest(unittest.TestCase):
    def test_spaces(self):
        self.assertEqual(slugify("  a   b  "), "a-b")

    def test_digits(self):
        self.assertEqual(slugify("Version 2.0"), "version-2-0")
