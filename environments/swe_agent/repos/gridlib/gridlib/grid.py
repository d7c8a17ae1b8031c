"""A rectangular grid of characters, read from lines of text."""

from collections import deque


class Grid:
    def __init__(self, lines, wall="#"):
        if not lines:
            raise ValueError("a grid needs at least one line")
        width = len(lines[0])
        if any(len(line) != width for line in lines):
            raise ValueError("all lines must have the same length")
        self.rows = [list(line) for line in lines]
        self.wall = wall

    @property
    def width(self):
        return len(self.rows[0])

    @property
    def height(self):
        return len(self.rows)

    def inside(self, x, y):
        return 0 <= x < self.width and 0 <= y < self.height

    def get(self, x, y, default=None):
        if not self.inside(x, y):
            return default
        return self.rows[y][x]

    def neighbours(self, x, y, diagonal=False):
        """In-grid neighbours of (x, y): up, down, left, right (and the diagonals with `diagonal`)."""
        steps = [(0, -1), (0, 1), (-1, 0), (1, 0)]
        if diagonal:
            steps += [(-1, -1), (1, -1), (-1, 1), (1, 1)]
        return [(x + dx, y + dy) for dx, dy in steps if self.inside(x + dx, y + dy)]

    def open_cells(self):
        return [(x, y) for y in range(self.height) for x in range(self.width) if self.rows[y][x] != self.wall]

    def count(self, char):
        return sum(row.count(char) for row in self.rows)

    def flood_fill(self, x, y, char):
        """Replace the 4-connected region of the character at (x, y) with `char`; returns its size."""
        target = self.get(x, y)
        if target is None or target == char:
            return 0
        queue = deque([(x, y)])
        self.rows[y][x] = char
        filled = 1
        while queue:
            cx, cy = queue.popleft()
            for nx, ny in self.neighbours(cx, cy):
                if self.rows[ny][nx] == target:
                    self.rows[ny][nx] = char
                    filled += 1
                    queue.append((nx, ny))
        return filled

    def shortest_path(self, start, goal):
        """Number of steps of the shortest 4-connected path avoiding walls, or -1 if there is none."""
        if self.get(*start) in (None, self.wall) or self.get(*goal) in (None, self.wall):
            return -1
        seen = {start}
        queue = deque([(start, 0)])
        while queue:
            (cx, cy), steps = queue.popleft()
            if (cx, cy) == goal:
                return steps
            for nxt in self.neighbours(cx, cy):
                if nxt not in seen and self.get(*nxt) != self.wall:
                    seen.add(nxt)
                    queue.append((nxt, steps + 1))
        return -1

    def render(self):
        return "\n".join("".join(row) for row in self.rows)


def transpose(lines):
    """Rows become columns."""
    return ["".join(line[i] for line in lines) for i in range(len(lines[0]))] if lines else []


def rotate_clockwise(lines):
    return ["".join(reversed(col)) for col in transpose(lines)]
