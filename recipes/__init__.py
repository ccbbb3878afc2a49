"""Recipes: strategy presets, training entry points and configs."""
