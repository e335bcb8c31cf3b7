"""The daemon process: wiring the parts, serving, reloads, systemd notify and socket activation."""
