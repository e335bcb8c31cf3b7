"""npm packages for the tests that run real JavaScript clients under node (markers ``npm`` and
``webui``): installed once per version into a cache dir outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def cache_root() -> Path:
    """Where installed packages are kept between runs (``MODELD_TEST_NPM_CACHE`` overrides)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.environ.get("MODELD_TEST_NPM_CACHE") or Path(base) / "modeld-tests" / "npm")


def installed(*packages: str) -> Path:
    """A dir whose ``node_modules`` holds ``packages`` (``name@version``), installed by npm
    from the registry the first time; the packages' names make the dir's name."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise RuntimeError("node and npm are needed (Debian: apt-get install nodejs npm)")
    where = cache_root() / "+".join(p.replace("/", "_") for p in sorted(packages))
    done = where / ".installed"
    if done.exists():
        return where
    where.mkdir(parents=True, exist_ok=True)
    (where / "package.json").write_text('{"private": true, "type": "module"}\n')
    subprocess.run(
        ["npm", "install", "--no-audit", "--no-fund", "--silent", *packages],
        cwd=where,
        check=True,
        timeout=600,
    )
    done.write_text("\n".join(packages) + "\n")
    return where


def node_script(script: Path, where: Path, into: Path) -> Path:
    """``script`` copied into ``into`` beside a link to ``where``'s ``node_modules``: node
    resolves an ES module's imports from the script's own dir, never from NODE_PATH."""
    into.mkdir(parents=True, exist_ok=True)
    (into / "node_modules").symlink_to(where / "node_modules")
    (into / "package.json").write_text('{"private": true, "type": "module"}\n')
    copy = into / script.name
    shutil.copyfile(script, copy)
    return copy
