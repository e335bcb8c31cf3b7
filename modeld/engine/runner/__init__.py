"""The runner child process that owns one runtime engine, and the client the pool drives it with."""
