"""Points are (x, y) tuples of integers; rectangles are (left, top, width, height)."""


def manhattan(a, b):
    return abs(a[0] - b[0]) + abs(a[1] - b[1])


def chebyshev(a, b):
    return max(abs(a[0] - b[0]), abs(a[1] - b[1]))


def translate(point, dx=0, dy=0):
    return (point[0] + dx, point[1] + dy)


def contains(rect, point):
    """True if `point` lies inside `rect` (the right and bottom edges are outside)."""
    left, top, width, height = rect
    x, y = point
    return left <= x < left + width and top <= y < top + height


def area(rect):
    return rect[2] * rect[3]


def intersection(a, b):
    """The overlapping rectangle of `a` and `b`, or None when they do not overlap."""
    left = max(a[0], b[0])
    top = max(a[1], b[1])
    right = min(a[0] + a[2], b[0] + b[2])
    bottom = min(a[1] + a[3], b[1] + b[3])
    if right <= left or bottom <= top:
        return None
    return (left, top, right - left, bottom - top)


def bounding_box(points):
    """The smallest rectangle containing every point, or None for no points."""
    if not points:
        return None
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return (min(xs), min(ys), max(xs) - min(xs) + 1, max(ys) - min(ys) + 1)


def scale(rect, factor, origin=(0, 0)):
    """`rect` scaled by the integer `factor` about `origin`."""
    ox, oy = origin
    left, top, width, height = rect
    return (ox + (left - ox) * factor, oy + (top - oy) * factor, width * factor, height * factor)
