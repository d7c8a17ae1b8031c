import unittest

from gridlib.grid import Grid, rotate_clockwise, transpose

MAZE = [
    "..#..",
    ".##.#",
    ".....",
]


class TestGrid(unittest.TestCase):
    def test_shape_checked(self):
        with self.assertRaises(ValueError):
            Grid(["ab", "c"])
        with self.assertRaises(ValueError):
            Grid([])

    def test_size(self):
        grid = Grid(MAZE)
        self.assertEqual((grid.width, grid.height), (5, 3))

    def test_get_outside_uses_default(self):
        grid = Grid(MAZE)
        self.assertEqual(grid.get(2, 0), "#")
        self.assertIsNone(grid.get(5, 0))
        self.assertEqual(grid.get(-1, 0, default="?"), "?")

    def test_neighbours_in_corner(self):
        self.assertEqual(sorted(Grid(MAZE).neighbours(0, 0)), [(0, 1), (1, 0)])

    def test_neighbours_diagonal(self):
        self.assertEqual(len(Grid(MAZE).neighbours(1, 1, diagonal=True)), 8)
        self.assertEqual(len(Grid(MAZE).neighbours(1, 1)), 4)

    def test_open_cells_and_count(self):
        grid = Grid(MAZE)
        self.assertEqual(len(grid.open_cells()), 11)
        self.assertEqual(grid.count("#"), 4)

    def test_flood_fill(self):
        grid = Grid(["aab", "abb", "aaa"])
        self.assertEqual(grid.flood_fill(0, 0, "x"), 6)
        self.assertEqual(grid.render(), "xxb\nxbb\nxxx")
        self.assertEqual(grid.flood_fill(0, 0, "x"), 0)

    def test_shortest_path(self):
        grid = Grid(MAZE)
        self.assertEqual(grid.shortest_path((0, 0), (4, 0)), 8)
        self.assertEqual(grid.shortest_path((0, 0), (0, 0)), 0)

    def test_no_path(self):
        grid = Grid([".#.", "##.", "..."])
        self.assertEqual(grid.shortest_path((0, 0), (2, 2)), -1)
        self.assertEqual(grid.shortest_path((0, 0), (1, 0)), -1)


class TestTransforms(unittest.TestCase):
    def test_transpose(self):
        self.assertEqual(transpose(["ab", "cd", "ef"]), ["ace", "bdf"])
        self.assertEqual(transpose([]), [])

    def test_rotate(self):
        self.assertEqual(rotate_clockwise(["ab", "cd"]), ["ca", "db"])
