"""The model registry: entries from TOML files, validated, merged across dirs, live-reloaded."""
