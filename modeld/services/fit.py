"""Whether a model fits the memory budget, before any byte of it is downloaded.

The estimate is the engine pool's own (``modeld.engine.engines``): from the installed
file's header when there is one, else from the entry's size and limits. A model whose
text-only engine needs more than ``MODELD_MEMORY_BUDGET`` could never load (the pool would
refuse it with ``over_budget``), so a pull of it is refused before it starts, unless forced.
An entry's ``variants`` name other entries of the same model: a pull takes the best of
them that fits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from modeld.catalog.catalog import Catalog, Entry
from modeld.config import Settings, format_size
from modeld.engine.engines import (
    Engines,
    entry_max_tokens,
    estimate_from_size,
    estimate_memory,
)
from modeld.errors import ModeldError, OverBudget
from modeld.modelfile.plan import Plan
from modeld.store.store import Installed, Store

# Where a figure came from, as ``list --json`` and the pull records name it.
FROM_FILE = "file"  # the installed file's header: its sections' sizes
FROM_ENTRY = "entry"  # the registry entry's size and limits (nothing downloaded yet)


@dataclass(frozen=True)
class Fit:
    """One model's estimated need against the budget."""

    model_id: str
    needs: int
    budget: int
    source: str
    max_tokens: int

    @property
    def fits(self) -> bool:
        return self.needs <= self.budget

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_id,
            "fits": self.fits,
            "needs": self.needs,
            "budget": self.budget,
            "source": self.source,
            "max_tokens": self.max_tokens,
        }

    def describe(self) -> str:
        where = "its file" if self.source == FROM_FILE else "its entry's size"
        return (
            f"{self.model_id} needs about {format_size(self.needs)} (estimated from {where}, "
            f"{self.max_tokens} tokens)"
        )


class Fits:
    """Estimates and variant choices over the catalog, the store and the engines' headers."""

    def __init__(
        self, settings: Settings, catalog: Catalog, store: Store, engines: Engines
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.store = store
        self.engines = engines

    async def of(self, entry: Entry, installed: Installed | None = None) -> Fit:
        """``entry``'s fit: from the installed file's header if any, else from the entry."""
        budget = int(self.settings.memory_budget)
        if installed is not None and installed.path.is_file():
            try:
                info = await self.engines.header(entry.id, installed.digest, installed.path)
            except (ModeldError, OSError):
                info = None
            if info is not None:
                max_tokens = entry_max_tokens(entry, info)
                # A text-only plan is the smallest engine the file can have.
                needs = estimate_memory(info, Plan(main="cpu"), max_tokens)
                return Fit(entry.id, needs, budget, FROM_FILE, max_tokens)
        max_tokens = entry_max_tokens(entry, None)
        return Fit(
            entry.id, estimate_from_size(entry.size, max_tokens), budget, FROM_ENTRY, max_tokens
        )

    async def of_id(self, model_id: str) -> Fit:
        return await self.of(self.catalog.get(model_id), await self.store.installed(model_id))

    async def choose(self, model_id: str, *, force: bool = False) -> dict[str, Any]:
        """Which entry a ``pull model_id`` downloads, and why; refuse one that never fits.

        The entry asked for when it fits (or with ``force``); else, of its variants that
        fit, the one that needs the most memory: the closest to what was asked (a larger
        quantization or size is the better model). None fitting is ``OverBudget``.
        """
        asked = self.catalog.get(model_id)
        asked_fit = await self.of_id(model_id)
        if asked_fit.fits or force:
            reason = "it fits the memory budget" if asked_fit.fits else "forced (--force)"
            return {"asked": model_id, "chosen": model_id, "reason": reason, "fit": asked_fit}
        variants = [v for v in asked.variants if v != model_id and v in self.catalog]
        fits = [await self.of_id(v) for v in variants]
        fitting = [f for f in fits if f.fits]
        budget = format_size(asked_fit.budget)
        if fitting:
            best = max(fitting, key=lambda f: f.needs)
            reason = (
                f"{asked_fit.describe()}, over the memory budget {budget}; took its variant "
                f"{best.model_id} (needs about {format_size(best.needs)}), the largest of "
                f"its variants that fits"
            )
            return {"asked": model_id, "chosen": best.model_id, "reason": reason, "fit": best}
        others = "".join(f"; {f.describe()}" for f in fits)
        smallest = min([asked_fit, *fits], key=lambda f: f.needs)
        raise OverBudget(
            f"model {model_id} can never load here: {asked_fit.describe()}{others}; the memory "
            f"budget is {budget}. Raise MODELD_MEMORY_BUDGET to at least "
            f"{format_size(smallest.needs)}, lower [limits] max_tokens in its registry "
            f"entry, choose a smaller model, or download it anyway with `modeld pull "
            f"{model_id} --force`",
            model=model_id,
            needs=asked_fit.needs,
            budget=asked_fit.budget,
            variants={f.model_id: f.needs for f in fits},
        )
