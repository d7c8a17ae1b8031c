import unittest

from gridlib.geometry import (
    area,
    bounding_box,
    chebyshev,
    contains,
    intersection,
    manhattan,
    scale,
    translate,
)


class TestDistances(unittest.TestCase):
    def test_manhattan(self):
        self.assertEqual(manhattan((1, 2), (4, -2)), 7)

    def test_chebyshev(self):
        self.assertEqual(chebyshev((1, 2), (4, -2)), 4)

    def test_translate(self):
        self.assertEqual(translate((1, 1), dx=2), (3, 1))
        self.assertEqual(translate((1, 1), dy=-1), (1, 0))


class TestRectangles(unittest.TestCase):
    def test_contains_edges(self):
        rect = (0, 0, 3, 2)
        self.assertTrue(contains(rect, (0, 0)))
        self.assertTrue(contains(rect, (2, 1)))
        self.assertFalse(contains(rect, (3, 1)))
        self.assertFalse(contains(rect, (2, 2)))

    def test_area(self):
        self.assertEqual(area((5, 5, 3, 4)), 12)

    def test_intersection(self):
        self.assertEqual(intersection((0, 0, 4, 4), (2, 1, 5, 5)), (2, 1, 2, 3))

    def test_touching_rectangles_do_not_intersect(self):
        self.assertIsNone(intersection((0, 0, 2, 2), (2, 0, 2, 2)))

    def test_bounding_box(self):
        self.assertEqual(bounding_box([(1, 5), (3, 2), (2, 2)]), (1, 2, 3, 4))
        self.assertIsNone(bounding_box([]))

    def test_scale(self):
        self.assertEqual(scale((1, 2, 3, 4), 2), (2, 4, 6, 8))
        self.assertEqual(scale((1, 2, 3, 4), 2, origin=(1, 1)), (1, 3, 6, 8))
