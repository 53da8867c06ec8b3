"""observability package."""
