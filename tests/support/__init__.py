"""Helpers shared by the tests: daemons, requests over Unix sockets, mirrors, the fake runner."""
