"""The state dir: its layout, the SQLite index (schema, records), blobs and the start-up scan."""
