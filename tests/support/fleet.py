"""Engines a fleet of daemons runs behind, started on loopback for the ``fleet`` tests.

Each is a real program from Debian or PyPI, found on PATH (or through an environment
variable); a test that lacks one skips saying what to install (docs/fleet.md lists them).
Nothing here installs anything:

- ``Nginx``: nginx with ``proxy_cache`` and its ``slice`` module, as the site cache
  (``cache_conf``: the docs' recipe, upstream over http on loopback);
- ``Prometheus``: Debian's ``prometheus``, scraping daemons' ``/metrics``;
- ``LiteLLM``: LiteLLM's proxy (``litellm``), routing OpenAI requests over daemons.

``Fleet`` runs stand-in hubs on a loop in a thread and daemons as ``modeld serve``
subprocesses, as an admin would.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import DaemonProcess, daemon_env, stop_process
from tests.support.hub import Hub, start_hub
from tests.support.mirror import COMMIT, Faults, LoopThread, pinned_path
from tests.support.state import write_entry
from tests.support.wait import wait_sync

START_TIMEOUT = 60.0


def need(program: str, what: str, env: str | None = None) -> str:
    """The path of ``program`` (or of ``$env``), else skip the test saying how to get it."""
    path = os.environ.get(env) if env else None
    found = path if path and Path(path).is_file() else shutil.which(program)
    if found is None:
        where = f" (or set {env} to it)" if env else ""
        pytest.skip(f"{program} is not installed{where}: {what}; see docs/fleet.md")
    return found


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Wait until something listens on 127.0.0.1:``port``; fail with ``log`` if ``proc`` died."""

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"exited {proc.returncode}:\n{log.read_text(errors='replace')}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_sync(listening, timeout, what=f"a listener on port {port}")


def http_get(url: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> Any:
    """GET ``url`` (loopback only) and parse its JSON body."""
    assert url.startswith("http://127.0.0.1:"), url
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        return json.loads(resp.read())


# --- the site cache -------------------------------------------------------------------


def cache_conf(root: Path, port: int, slice_size: str = "1m") -> str:
    """nginx's config for a site cache on 127.0.0.1:``port``, state under ``root``.

    The ``server`` block is the recipe of docs/fleet.md with the origin asked over http (the
    stand-ins are on loopback) and ``localhost`` mapped to 127.0.0.1 (no resolver here).
    """
    user = "user root;\n" if os.geteuid() == 0 else ""
    return f"""{user}daemon off;
worker_processes 2;
error_log {root}/error.log info;
pid {root}/nginx.pid;
events {{ worker_connections 512; }}
http {{
  access_log {root}/access.log;
  client_body_temp_path {root}/tmp/body;
  proxy_temp_path {root}/tmp/proxy;
  fastcgi_temp_path {root}/tmp/fastcgi;
  uwsgi_temp_path {root}/tmp/uwsgi;
  scgi_temp_path {root}/tmp/scgi;
  proxy_cache_path {root}/cache levels=1:2 keys_zone=models:10m max_size=20g inactive=30d
                   use_temp_path=off;
  map $origin_host $origin_addr {{
    ~^localhost(?<origin_port>:[0-9]+)?$ 127.0.0.1$origin_port;
    default $origin_host;
  }}
  server {{
    listen 127.0.0.1:{port};
    location ~ ^/(?<origin_host>[^/]+)(?<origin_path>/.*)$ {{
      slice {slice_size};
      proxy_cache models;
      proxy_cache_key $origin_host$origin_path$slice_range;
      proxy_cache_valid 200 206 30d;
      proxy_cache_lock on;
      proxy_cache_lock_timeout 10m;
      proxy_cache_lock_age 10m;
      proxy_ignore_client_abort on;
      proxy_set_header Range $slice_range;
      proxy_set_header Host $origin_host;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_redirect off;
      proxy_pass http://$origin_addr$origin_path$is_args$args;
      add_header X-Cache-Status $upstream_cache_status always;
    }}
  }}
}}
"""


@dataclass
class Nginx:
    """A running nginx (``daemon off``) with its config, log and cache under ``root``."""

    root: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def label(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, conf: str | None = None) -> Nginx:
        binary = need("nginx", "Debian's nginx (with its slice module)")
        built = subprocess.run([binary, "-V"], capture_output=True, text=True, check=False)
        if "--with-http_slice_module" not in built.stderr:
            pytest.skip("this nginx has no slice module (nginx -V); see docs/fleet.md")
        for sub in ("tmp", "cache"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        path = self.root / "nginx.conf"
        path.write_text(conf or cache_conf(self.root, self.port))
        log = self.root / "stderr.log"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [binary, "-p", str(self.root), "-c", str(path), "-e", str(self.root / "error.log")],
                stdout=out,
                stderr=out,
            )
        wait_port(self.port, self.proc, log, START_TIMEOUT)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc, signal.SIGTERM, 20.0)

    def cached(self) -> Iterator[tuple[Path, str]]:
        """Each file of the cache with its key (``HOST[:PORT]/PATH`` then the slice's range)."""
        for path in (self.root / "cache").rglob("*"):
            if path.is_file():
                head = path.read_bytes()[:4096]
                start = head.find(b"\nKEY: ")
                if start >= 0:
                    end = head.index(b"\n", start + 6)
                    yield path, head[start + 6 : end].decode()

    def flip(self, key_part: str, offset: int, slice_size: int) -> Path:
        """Flip the byte at ``offset`` of the file in the cached slice that holds it (the
        key holding ``key_part``); returns the cache file changed."""
        start = offset - offset % slice_size
        for path, key in self.cached():
            if key_part in key and key.endswith(f"bytes={start}-{start + slice_size - 1}"):
                data = bytearray(path.read_bytes())
                body = data.index(b"\r\n\r\n", data.index(b"\nKEY: ")) + 4
                data[body + offset - start] ^= 0xFF
                path.write_bytes(bytes(data))
                return path
        raise AssertionError(f"no cached slice at {start} of {key_part}")


# --- daemons ----------------------------------------------------------------------------


@dataclass
class Daemons:
    """``modeld serve`` subprocesses, one state dir each under ``root``."""

    root: Path
    started: list[DaemonProcess] = field(default_factory=list)

    def start(self, name: str, **env: str) -> DaemonProcess:
        home = self.root / name
        home.mkdir(parents=True, exist_ok=True)
        daemon = DaemonProcess(home, daemon_env(home, **env))
        daemon.start_quick(START_TIMEOUT)
        self.started.append(daemon)
        return daemon

    def stop(self) -> None:
        for daemon in self.started:
            if daemon.proc is not None and daemon.proc.poll() is None:
                daemon.stop()


@dataclass
class Site:
    """A site of daemons behind a cache: the stand-in hub (on a loop in a thread) holding
    ``data`` as ``org/repo``'s ``m.litertlm``, nginx as the cache, a registry whose entry
    ``m`` pins it (no sha256: the origin's X-Linked-Etag decides), and the daemons."""

    hub: Hub
    loop: LoopThread
    cache: Nginx
    registry: Path
    daemons: Daemons

    @classmethod
    def open(cls, root: Path, data: bytes, sign_ttl: float) -> Site:
        loop = LoopThread()
        hub = loop.run(start_hub("127.0.0.1", Faults(sign_ttl=sign_ttl)))
        hub.add("org/repo", COMMIT, {"m.litertlm": data}, "main")
        registry = root / "registry"
        write_entry(registry, "m", size=len(data), urls=[f"{hub.endpoint}{pinned_path()}"])
        try:
            cache = Nginx(root / "nginx", free_port()).start()
        except BaseException:
            loop.run(hub.stop())
            loop.close()
            raise
        return cls(hub, loop, cache, registry, Daemons(root / "d"))

    def start(self, name: str, cache: str | None = None) -> DaemonProcess:
        """A daemon with the site's registry and cache (``cache`` instead, if given)."""
        return self.daemons.start(
            name,
            MODELD_REGISTRY=str(self.registry),
            MODELD_SITE_CACHE=self.cache.base if cache is None else cache,
            MODELD_PIECE_SIZE="4MiB",
            # The stand-in is a hub (its X-Linked-Etag vouches), as huggingface.co is.
            HF_ENDPOINT=self.hub.endpoint,
        )

    def close(self) -> None:
        self.daemons.stop()
        self.cache.stop()
        self.loop.run(self.hub.stop())
        self.loop.close()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pull(daemon: DaemonProcess, model: str, timeout: float = 600.0) -> dict[str, Any]:
    """``modeld pull MODEL --json`` on ``daemon``: the pull's last record."""
    out = daemon.cli("pull", model, "--json", timeout=timeout)
    assert out.returncode == 0, out.stderr + daemon.log()[-3000:]
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def pull_all(daemons: list[DaemonProcess], models: list[str], timeout: float = 600.0) -> list[Any]:
    """A pull on every daemon at once (one CLI each, ``models`` in order); their last records."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "modeld", "pull", model, "--json"],
            env=d.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for d, model in zip(daemons, models, strict=True)
    ]
    docs = []
    for d, p in zip(daemons, procs, strict=True):
        out, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err.decode() + d.log()[-3000:]
        docs.append(json.loads(out))
    return docs


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
