"""``/api/models`` routes and the ``list``/``show``/``verify`` verbs on a real daemon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from modeld.errors import ModelNotFound
from modeld.hostinfo import runtime_version
from modeld.store.store import sha256_file
from tests.support.daemon import DaemonProcess, daemon_env, running_daemon
from tests.support.state import MODELS, install_fixture, open_store, registry_settings, write_entry
from tests.support.wait import until

TINY = MODELS / "tiny-text.litertlm"
GEMMA3N_LIKE = MODELS / "gemma3n-like.litertlm"


async def _record_probe(home: Path, path: Path, backend: str, ok: bool, reason: str) -> None:
    async with open_store(home) as store:
        await store.record_probe(sha256_file(path)[0], backend, ok, reason)


async def test_list_shows_catalog_and_install_state(clean_env: Path) -> None:
    """The list holds bundled and local entries; the installed fixture is marked verified."""
    home, reg = clean_env / "home", clean_env / "reg"
    inst = install_fixture(home, "tiny", TINY, registry=reg)
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        doc = await c.models()
        by_id = {m["id"]: m for m in doc["models"]}
        assert by_id["gemma-4-E2B-it"]["state"] == "not_installed"
        assert by_id["gemma-4-E2B-it"]["installed"] is None
        tiny = by_id["tiny"]
        assert tiny["state"] == "installed"
        assert tiny["installed"]["digest"] == inst.digest
        assert tiny["installed"]["verified_by"] == "registry sha256"
        assert tiny["source"] == str(reg / "tiny.toml")
        only = await c.models(installed=True)
        assert [m["id"] for m in only["models"]] == ["tiny"]


async def test_show_text_model_has_sections_and_plans(clean_env: Path) -> None:
    """``show`` reads the installed file's header: sections, a text plan, no vision plan."""
    home, reg = clean_env / "home", clean_env / "reg"
    install_fixture(home, "tiny", TINY, registry=reg)
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        doc = await c.model("tiny")
        assert doc["entry"]["id"] == "tiny"
        kinds = [s["model_type"] for s in doc["header"]["sections"]]
        assert "tf_lite_prefill_decode" in kinds
        assert doc["plans"]["text"]["plan"]["key"] == "main=cpu,vision=none,audio=none"
        assert doc["plans"]["vision"]["plan"] is None
        assert doc["plans"]["vision"]["error"]["code"] == "refused"
        assert "no vision encoder" in doc["plans"]["vision"]["error"]["message"]


async def test_show_gemma3n_like_refuses_vision_on_cpu(clean_env: Path) -> None:
    """A vision encoder that requires gpu: text plans on cpu, vision=cpu is refused."""
    home, reg = clean_env / "home", clean_env / "reg"
    install_fixture(home, "g3n", GEMMA3N_LIKE, registry=reg)
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        doc = await c.model("g3n")
        vision = [
            s for s in doc["header"]["sections"] if s["model_type"] == "tf_lite_vision_encoder"
        ]
        assert vision[0]["backend_constraint"] == ["gpu"]
        assert doc["header"]["backend_constraints"]["vision"] == ["gpu"]
        assert doc["plans"]["text"]["plan"]["main"] == "cpu"
        err = doc["plans"]["vision"]["error"]
        assert err["code"] == "backend_constraint"
        assert "requires one of [gpu] but vision backend is cpu" in err["message"]


async def test_show_uses_stored_probe_results(clean_env: Path) -> None:
    """A failed GPU probe for the file is shown and makes main=gpu fall back to cpu."""
    home, reg = clean_env / "home", clean_env / "reg"
    install_fixture(home, "tiny", TINY, registry=reg)
    await _record_probe(home, TINY, "gpu", False, "no GPU device")
    async with (
        running_daemon(registry_settings(home, reg, main_backend="gpu")) as d,
        d.client() as c,
    ):
        doc = await c.model("tiny")
        assert doc["probes"]["gpu"]["ok"] is False
        assert doc["probes"]["gpu"]["reason"] == "no GPU device"
        text = doc["plans"]["text"]["plan"]
        assert (text["main"], text["fell_back"]) == ("cpu", True)


async def test_show_not_installed_and_unknown(clean_env: Path) -> None:
    """A catalog entry not installed has no plan and says to pull; unknown ids are 404."""
    home, reg = clean_env / "home", clean_env / "reg"
    reg.mkdir()
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        doc = await c.model("gemma-3n-E2B-it")
        assert doc["state"] == "not_installed"
        assert doc["header"] is None
        err = doc["plans"]["text"]["error"]
        assert err["code"] == "model_not_installed"
        assert "modeld pull gemma-3n-E2B-it" in err["message"]
        with pytest.raises(ModelNotFound):
            await c.model("no-such-model")
        with pytest.raises(ModelNotFound):
            await c.verify("no-such-model")


async def test_show_corrupt_file_reports_header_error(clean_env: Path, tmp_path: Path) -> None:
    """An installed file that is not a LiteRT-LM file shows corrupt_model, not a crash."""
    home, reg = clean_env / "home", clean_env / "reg"
    junk = tmp_path / "junk.litertlm"
    junk.write_bytes(b"NOTLITERT" * 100)
    install_fixture(home, "junk", junk, registry=reg)
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        doc = await c.model("junk")
        assert doc["header_error"]["code"] == "corrupt_model"
        assert doc["plans"]["text"]["error"]["code"] == "corrupt_model"


async def test_verify_upgrades_unverified_when_the_entry_vouches(clean_env: Path) -> None:
    """An unverified install whose bytes match the entry's sha256 becomes verified."""
    home, reg = clean_env / "home", clean_env / "reg"
    install_fixture(home, "tiny", TINY, registry=reg, verified_by=None)
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        before = await c.model("tiny")
        assert before["installed"]["verified"] is False
        report = await c.verify("tiny")
        assert report["ok"] is True
        assert report["verified_by"] == "registry sha256"
        after = await c.model("tiny")
        assert after["installed"]["verified_by"] == "registry sha256"


async def test_outdated_after_live_registry_change_and_status(clean_env: Path) -> None:
    """Editing the entry's sha256 marks the install outdated; bad files show in status."""
    home, reg = clean_env / "home", clean_env / "reg"
    inst = install_fixture(home, "tiny", TINY, registry=reg)
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        write_entry(reg, "tiny", size=inst.size, sha256="0" * 64)
        (reg / "typo.toml").write_text('id = "typo"\nsizee = 3\n')

        async def outdated() -> bool:
            m = await c.model("tiny")
            return bool(m["state"] == "outdated" and m["installed"]["outdated"])

        await until(outdated)
        status = await c.status()
        assert "typo.toml" in " ".join(status["catalog"]["problems"])
        keys = {p["key"] for p in status["catalog"]["problem_details"]}
        assert "sizee" in keys
        assert status["store"]["installed"] == 1
        report = await c.verify("tiny")
        assert (report["ok"], report["outdated"]) == (True, True)


# --- the CLI in a subprocess against a daemon subprocess ---------------------------------


@pytest.fixture
def cli_daemon(short_tmp: Path) -> Any:
    home, reg = short_tmp / "home", short_tmp / "reg"
    install_fixture(home, "tiny", TINY, registry=reg)
    install_fixture(home, "g3n", GEMMA3N_LIKE, registry=reg)
    d = DaemonProcess(home=home, env=daemon_env(home, MODELD_REGISTRY=str(reg)))
    d.start()
    yield d
    d.stop()


def test_cli_list_show_verify(cli_daemon: DaemonProcess) -> None:
    """``list``, ``show`` and ``verify`` print tables or one JSON document and exit 0."""
    d = cli_daemon
    doc = d.cli_json("list")
    assert {m["id"] for m in doc["models"]} >= {"tiny", "g3n", "gemma-4-E2B-it"}
    installed = d.cli_json("list", "--installed")
    assert sorted(m["id"] for m in installed["models"]) == ["g3n", "tiny"]
    human = d.cli("list")
    assert human.returncode == 0
    assert "gemma-4-E2B-it" in human.stdout
    assert "not installed" in human.stdout

    show = d.cli_json("show", "g3n")
    assert show["plans"]["vision"]["error"]["code"] == "backend_constraint"
    text = d.cli("show", "g3n")
    assert text.returncode == 0, text.stderr
    assert "backends=gpu" in text.stdout
    assert "Vision backend constraint mismatch" in text.stdout.replace("\n", " ")

    ok = d.cli_json("verify", "tiny")
    assert ok["ok"] is True
    assert d.cli("verify", "tiny").returncode == 0


def test_cli_verify_mismatch_and_unknown(cli_daemon: DaemonProcess) -> None:
    """A damaged blob fails verify (exit 1, quarantined); unknown ids exit 1 with a hint."""
    d = cli_daemon
    blob = Path(d.cli_json("show", "tiny")["installed"]["path"])
    blob.chmod(0o644)
    with blob.open("r+b") as f:
        f.seek(5000)
        f.write(b"\x00\x01")
    result = d.cli("verify", "tiny", "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["ok"] is False
    assert "modeld pull tiny" in result.stderr
    assert blob.with_name(blob.name + ".FAILED").exists()
    assert d.cli_json("show", "tiny")["state"] == "not_installed"

    unknown = d.cli("show", "nope")
    assert unknown.returncode == 1
    assert "modeld list" in unknown.stderr


async def test_status_shows_probe_results(clean_env: Path) -> None:
    """/api/status has a ``probes`` section with each recorded backend probe and its models."""
    home, reg = clean_env / "home", clean_env / "reg"
    inst = install_fixture(home, "tiny", TINY, registry=reg)
    async with open_store(home) as store:
        await store.record_probe(inst.digest, "gpu", False, "No adapters found")
    async with running_daemon(registry_settings(home, reg)) as d, d.client() as c:
        section = (await c.status())["probes"]
    assert section["summary"] == "1 result(s), 1 failed"
    assert section["results"] == [
        {
            "digest": inst.digest,
            "models": ["tiny"],
            "backend": "gpu",
            "ok": False,
            "reason": "No adapters found",
            "at": section["results"][0]["at"],
            "adapter": None,
            "runtime": runtime_version(),
            "current": True,
        }
    ]
