"""Stand-in package (see tensorflow/__init__.py)."""
