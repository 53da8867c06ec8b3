"""Seeded side-by-side comparisons of named variants (``armor compare``, docs/compare.md)."""
