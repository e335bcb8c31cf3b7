"""A ``.litertlm`` file: its header reader, the backend plan resolver and the GPU/vision probe."""
