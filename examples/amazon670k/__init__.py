"""Extreme classification on Amazon-670K (or data shaped like it) with SparseLSHLinear."""
