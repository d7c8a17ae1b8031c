"""gridlib: points, rectangles and character grids."""
