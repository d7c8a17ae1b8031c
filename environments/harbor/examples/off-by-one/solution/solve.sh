#!/bin/bash
sed -i 's/range(1, n)/range(1, n + 1)/' /app/mathlib/series.py
