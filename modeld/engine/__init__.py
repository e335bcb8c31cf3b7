"""Engines: the pool of runner processes, admission under the memory budget, views, ``runner/``."""
