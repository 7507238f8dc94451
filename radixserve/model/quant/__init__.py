"""Weight-only quantized formats of a projection (`model/linear.py` holds one of them)."""
