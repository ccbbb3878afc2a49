"""The planner behind ``python -m recipes.plan``; see README.md in this folder."""
