"""The Haiku adapter's machinery; ``partition.haiku`` is its public face (see README.md)."""
