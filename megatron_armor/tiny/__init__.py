"""tiny package."""
