"""modeld: a model lifecycle manager for on-device LLMs in the LiteRT-LM format."""

__version__ = "0.1.0"
