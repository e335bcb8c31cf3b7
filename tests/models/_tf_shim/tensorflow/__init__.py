"""Stand-in for the bits of TensorFlow that litert-torch imports (build-time only).

litert-torch imports ``tensorflow.lite.python.schema_py_generated`` without
depending on TensorFlow; ``tests/models/build.py`` puts ``_tf_shim`` on
``sys.path`` so that import resolves to ``ai_edge_litert``'s copy instead.
"""
