"""planner package."""
