"""See README.md in this folder: what this group owns and what it may import."""
