"""Re-exports the TFLite flatbuffer schema shipped by ``ai_edge_litert``."""

from ai_edge_litert.schema_py_generated import *  # noqa: F403
