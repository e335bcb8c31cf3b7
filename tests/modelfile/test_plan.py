"""Tests for modeld.modelfile.plan: table-driven rules, properties, and agreement with the
runtime.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modeld.config import Settings
from modeld.errors import BackendConstraint, BadRequest, Refused
from modeld.modelfile.header import ModelInfo, Role, Section, read_header
from modeld.modelfile.plan import Plan, Prefs, needs_probe, normalize_modalities, resolve
from modeld.modelfile.probe import ProbeResult, probe
from tests.support.state import MODELS

FIXTURES = sorted(MODELS.glob("*.litertlm"))
ABSENT = "absent"
# A role's section: ABSENT (no such section), None (unconstrained) or the allowed set.
Spec = frozenset[str] | None | str


def make_info(main: Spec = None, vision: Spec = ABSENT, audio: Spec = ABSENT) -> ModelInfo:
    """A ModelInfo with one section per present role, constrained as given."""
    sections = []
    for i, (model_type, spec) in enumerate(
        [
            ("tf_lite_prefill_decode", main),
            ("tf_lite_vision_encoder", vision),
            ("tf_lite_audio_encoder_hw", audio),
        ]
    ):
        if spec == ABSENT:
            continue
        constraint = spec if isinstance(spec, frozenset) else None
        begin = 16384 * (i + 1)
        sections.append(Section(i, "TFLiteModel", begin, begin + 100, model_type, constraint))
    return ModelInfo((1, 7, 0), tuple(sections), None, 16384 * 5, 600)


GPU = frozenset({"gpu"})
CPU = frozenset({"cpu"})
GEMMA3N = make_info(vision=GPU)
DEFAULTS = Prefs(main="gpu", vision="cpu", audio="cpu")


def test_text_on_gemma3n_plans_no_vision() -> None:
    """A text-only request never loads the vision encoder, so its gpu constraint is not hit."""
    plan = resolve(GEMMA3N, model="g", settings=DEFAULTS, probes={"gpu": None})
    assert plan == Plan(main="gpu", vision=None, audio=None)
    assert needs_probe(plan, {"gpu": None}) == {"gpu"}
    assert needs_probe(plan, {"gpu": True}) == frozenset()


def test_gpu_probe_failed_falls_back_to_cpu() -> None:
    """main=gpu from the settings falls back to cpu when the probe failed and cpu is allowed."""
    plan = resolve(GEMMA3N, model="g", settings=DEFAULTS, probes={"gpu": False})
    assert plan == Plan(main="cpu", fell_back=True)
    assert plan.key == "main=cpu,vision=none,audio=none"
    assert needs_probe(plan, {"gpu": False}) == frozenset()


def test_gpu_probe_ok_keeps_gpu() -> None:
    """A working GPU probe keeps main on gpu."""
    assert resolve(GEMMA3N, model="g", settings=DEFAULTS, probes={"gpu": True}).main == "gpu"


def test_vision_cpu_on_gpu_only_encoder_is_refused_in_runtime_terms() -> None:
    """An image request with vision=cpu on a gpu-only encoder is refused, naming the fix."""
    with pytest.raises(BackendConstraint) as exc:
        resolve(GEMMA3N, model="gemma3n-like", settings=DEFAULTS, modalities=["image"])
    assert exc.value.message == (
        "model gemma3n-like: Vision backend constraint mismatch: model requires one of [gpu] "
        "but vision backend is cpu. Set MODELD_VISION_BACKEND=gpu (needs a GPU) or send a "
        "text-only request."
    )
    assert exc.value.status == 422
    assert exc.value.details["role"] == "vision"


@pytest.mark.parametrize(
    ("entry", "request_", "fix"),
    [
        (Prefs(vision="cpu"), None, 'Set vision = "gpu" in the registry entry\'s [backends]'),
        (None, Prefs(vision="cpu"), "Ask for vision backend gpu"),
    ],
)
def test_refusal_names_the_layer_that_chose(
    entry: Prefs | None, request_: Prefs | None, fix: str
) -> None:
    """The fix in the message points at the layer the backend came from."""
    with pytest.raises(
        BackendConstraint, match=r"\. " + fix.replace("[", r"\[").replace("]", r"\]")
    ):
        resolve(
            GEMMA3N,
            model="m",
            settings=Prefs(main="cpu", vision="gpu"),
            entry=entry,
            request=request_,
            modalities=["image"],
        )


def test_vision_gpu_is_planned_when_asked_and_gpu_works() -> None:
    """vision=gpu from the request is kept on a gpu-only encoder when the GPU works."""
    plan = resolve(
        GEMMA3N,
        model="g",
        settings=DEFAULTS,
        request=Prefs(vision="gpu"),
        modalities=["vision"],
        probes={"gpu": True},
    )
    assert plan == Plan(main="gpu", vision="gpu")


def test_vision_gpu_is_refused_when_gpu_probe_failed() -> None:
    """Main may fall back, but a vision backend of gpu is never changed: it is refused."""
    with pytest.raises(BackendConstraint, match="GPU probe for this file failed"):
        resolve(
            GEMMA3N,
            model="g",
            settings=Prefs(main="gpu", vision="gpu"),
            modalities=["image"],
            probes={"gpu": False},
        )


def test_image_without_vision_encoder_is_refused() -> None:
    """An image for a text-only file is refused (422), not a backend constraint."""
    with pytest.raises(Refused, match="has no vision encoder") as exc:
        resolve(make_info(), model="t", settings=DEFAULTS, modalities=["text", "image"])
    assert not isinstance(exc.value, BackendConstraint)
    assert exc.value.status == 422


def test_audio_follows_the_vision_rules() -> None:
    """Audio is planned only when asked, and a mismatch is refused in the same terms."""
    info = make_info(audio=CPU)
    assert resolve(info, model="a", settings=DEFAULTS).audio is None
    assert resolve(info, model="a", settings=DEFAULTS, modalities=["audio"]).audio == "cpu"
    mismatch = r"Audio backend constraint mismatch.*Ask for audio"
    with pytest.raises(BackendConstraint, match=mismatch):
        resolve(
            info, model="a", settings=DEFAULTS, request=Prefs(audio="gpu"), modalities=["audio"]
        )
    with pytest.raises(Refused, match="no audio encoder"):
        resolve(make_info(), model="a", settings=DEFAULTS, modalities=["audio"])


@pytest.mark.parametrize(
    ("main", "asked", "probe_ok", "expected"),
    [
        (CPU, "gpu", None, "Main backend constraint mismatch.*Set MODELD_MAIN_BACKEND=cpu\\."),
        (GPU, "cpu", None, "requires one of \\[gpu\\] but main backend is cpu.*needs a GPU"),
        (GPU, "gpu", False, "GPU probe for this file failed.*allows only \\[gpu\\]"),
        (frozenset({"gpu_artisan"}), "gpu", None, "This host cannot run it"),
    ],
)
def test_main_refusals(
    main: frozenset[str], asked: str, probe_ok: bool | None, expected: str
) -> None:
    """main is refused when its constraint excludes the asked backend and no fallback applies."""
    with pytest.raises(BackendConstraint, match=expected):
        resolve(
            make_info(main=main), model="m", settings=Prefs(main=asked), probes={"gpu": probe_ok}
        )


def test_explicit_gpu_request_is_not_silently_moved() -> None:
    """A request that explicitly asks main=gpu is refused when the probe failed, not moved."""
    with pytest.raises(BackendConstraint, match="the request asked for gpu"):
        resolve(
            GEMMA3N, model="g", settings=DEFAULTS, request=Prefs(main="gpu"), probes={"gpu": False}
        )


def test_layers_override_in_order() -> None:
    """The request beats the entry, which beats the settings."""
    s = Prefs(main="gpu", vision="cpu")
    info = make_info(vision=None)
    assert resolve(info, model="m", settings=s, entry=Prefs(main="cpu")).main == "cpu"
    plan = resolve(
        info,
        model="m",
        settings=s,
        entry=Prefs(main="cpu", vision="gpu"),
        request=Prefs(main="gpu"),
        modalities=["image"],
    )
    assert (plan.main, plan.vision) == ("gpu", "gpu")


def test_bad_inputs_are_bad_requests() -> None:
    """Unknown backends, roles and modalities are 400s naming what is allowed."""
    with pytest.raises(BadRequest, match="is not one of cpu, gpu"):
        resolve(GEMMA3N, model="m", settings=DEFAULTS, request=Prefs(main="tpu"))
    with pytest.raises(BadRequest, match="unknown modality"):
        normalize_modalities(["smell"])
    with pytest.raises(BadRequest, match="unknown backend role"):
        Prefs.from_mapping({"decoder": "cpu"})
    assert Prefs.from_mapping({"main": "cpu", "vision": None}) == Prefs(main="cpu")
    assert normalize_modalities(["vision"]) == {"text", "image"}


def test_from_settings(clean_env: Path) -> None:
    """Settings give main and vision; audio defaults to cpu."""
    prefs = Prefs.from_settings(Settings(main_backend="cpu", vision_backend="gpu"))
    assert prefs == Prefs(main="cpu", vision="gpu", audio="cpu")


def test_plan_to_dict() -> None:
    """to_dict carries the backends, whether main fell back, and the engine key."""
    assert Plan(main="gpu", vision="cpu").to_dict() == {
        "main": "gpu",
        "vision": "cpu",
        "audio": None,
        "fell_back": False,
        "key": "main=gpu,vision=cpu,audio=none",
    }


# --- properties ---------------------------------------------------------------------------

backends = st.sampled_from(["cpu", "gpu"])
specs = st.one_of(
    st.just(ABSENT),
    st.none(),
    st.frozensets(st.sampled_from(["cpu", "gpu", "npu", "gpu_artisan"]), min_size=1),
)
prefs = st.builds(
    Prefs, main=st.none() | backends, vision=st.none() | backends, audio=st.none() | backends
)


def _first(*values: str | None) -> str:
    return next(v for v in values if v is not None)


@settings(max_examples=500, deadline=None)
@given(
    main=specs.filter(lambda s: s != ABSENT),
    vision=specs,
    audio=specs,
    settings_=st.builds(Prefs, main=backends, vision=backends, audio=backends),
    entry=prefs,
    request=prefs,
    modalities=st.sets(st.sampled_from(["text", "image", "audio"])),
    gpu_probe=st.sampled_from([None, True, False]),
)
def test_plan_properties(
    main: Spec,
    vision: Spec,
    audio: Spec,
    settings_: Prefs,
    entry: Prefs,
    request: Prefs,
    modalities: set[str],
    gpu_probe: bool | None,
) -> None:
    """Plans satisfy every constraint, keep vision/audio as asked, fall back only as documented."""
    info = make_info(main, vision, audio)
    probes = {"gpu": gpu_probe}
    asked = {
        role: _first(getattr(request, role), getattr(entry, role), getattr(settings_, role))
        for role in ("main", "vision", "audio")
    }
    main_section = info.role_section("main")
    assert main_section is not None
    gpu_failed = gpu_probe is False
    main_ok = (
        main_section.allows(asked["main"]) and not (asked["main"] == "gpu" and gpu_failed)
    ) or (
        asked["main"] == "gpu"
        and gpu_failed
        and main_section.allows("cpu")
        and request.main is None
    )
    modality_ok = True
    encoders: tuple[tuple[Role, str], ...] = (("vision", "image"), ("audio", "audio"))
    for role, modality in encoders:
        section = info.role_section(role)
        if modality in modalities:
            modality_ok &= (
                section is not None
                and section.allows(asked[role])
                and not (asked[role] == "gpu" and gpu_failed)
            )
    try:
        plan = resolve(
            info,
            model="m",
            settings=settings_,
            entry=entry,
            request=request,
            modalities=modalities,
            probes=probes,
        )
    except (BackendConstraint, Refused) as e:
        assert not (main_ok and modality_ok), e.message
        return
    assert main_ok and modality_ok
    planned: tuple[tuple[Role, str | None], ...] = (
        ("main", plan.main),
        ("vision", plan.vision),
        ("audio", plan.audio),
    )
    for role, backend in planned:
        section = info.role_section(role)
        if backend is not None:
            assert section is not None and section.allows(backend)
    assert plan.vision == (asked["vision"] if "image" in modalities else None)
    assert plan.audio == (asked["audio"] if "audio" in modalities else None)
    if plan.fell_back:
        assert (asked["main"], plan.main, gpu_probe) == ("gpu", "cpu", False)
        assert request.main is None
    else:
        assert plan.main == asked["main"]
    assert not (gpu_probe is False and "gpu" in plan.backends())


# --- agreement with the runtime -------------------------------------------------------------

VISIONS: list[str | None] = [None, "cpu", "gpu"]


@pytest.mark.timeout(90)
@pytest.mark.skipif(not FIXTURES, reason="no fixtures in tests/models/ yet")
async def test_resolver_refuses_exactly_what_the_runtime_refuses(tmp_path: Path) -> None:
    """For every fixture and plan, the resolver refuses iff the real runtime fails here."""
    limit = asyncio.Semaphore(4)

    async def run(path: Path, main: str, vision: str | None) -> ProbeResult:
        async with limit:
            return await probe(path, main, tmp_path / "cache", timeout=60, vision=vision)

    # An embedding model takes text only, so no vision plan is asked of one; its runtime
    # (EmbeddingEngine) also ignores a vision backend when the file has no vision encoder.
    grid = [
        (path, main, vision)
        for path, main, vision in itertools.product(FIXTURES, ["cpu", "gpu"], VISIONS)
        if vision is None or read_header(path).kind == "text"
    ]
    results = await asyncio.gather(*(run(*case) for case in grid))
    runtime = dict(zip(grid, results, strict=True))

    disagreements: list[str] = []
    for (path, main, vision), result in runtime.items():
        info = read_header(path)
        # The GPU probe that the daemon would feed the resolver: main=gpu, text only.
        gpu_probe = runtime[(path, "gpu", None)].ok
        refused: Any = None
        try:
            resolve(
                info,
                model=path.stem,
                settings=DEFAULTS,
                request=Prefs(main=main, vision=vision),
                modalities=["text", "image"] if vision else ["text"],
                probes={"gpu": gpu_probe},
            )
        except Refused as e:
            refused = e.message
        if (refused is None) != result.ok:
            disagreements.append(
                f"{path.name} main={main} vision={vision}: resolver "
                f"{'refused (' + refused + ')' if refused else 'accepted'}, runtime "
                f"{'ok' if result.ok else 'failed (' + str(result.reason) + ')'}"
            )
        # Whatever the settings-only resolver plans (fallback included) must run.
        if main == "gpu":
            try:
                plan = resolve(
                    info,
                    model=path.stem,
                    settings=Prefs(main="gpu", vision=vision or "cpu"),
                    modalities=["text", "image"] if vision else ["text"],
                    probes={"gpu": gpu_probe},
                )
            except Refused:
                continue
            if not runtime[(path, plan.main, plan.vision)].ok:
                disagreements.append(f"{path.name}: planned {plan.key} but the runtime fails it")
    assert not disagreements, "\n".join(disagreements)
