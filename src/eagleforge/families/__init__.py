"""Every draft family, behind one protocol (``base.Family``) and one registry: the builder,
the entry points and the judge ask here and never name a family. A family is its modules
under ``draft/`` (and its decoder, where it has its own), one line below, and its layouts'
lines in ``formats.directory.LAYOUTS``."""

from __future__ import annotations

from eagleforge.draft.config import DraftFamily
from eagleforge.errors import ConfigError
from eagleforge.families.base import DraftInputs, Family, init_from, not_applying
from eagleforge.families.dflash import DFlashFamily
from eagleforge.families.eagle3 import Eagle3Family
from eagleforge.families.peagle import PEagleFamily
from eagleforge.formats.directory import family_holding

FAMILIES: dict[DraftFamily, Family] = {
    DraftFamily.eagle3: Eagle3Family(),
    DraftFamily.dflash: DFlashFamily(),
    DraftFamily.peagle: PEagleFamily(),
}

__all__ = [
    "FAMILIES",
    "DraftInputs",
    "Family",
    "family_for",
    "family_of",
    "check_model_draft_defaults",
    "init_from",
    "not_applying",
]


def family_for(name: DraftFamily) -> Family:
    """The family ``draft.family`` names."""
    return FAMILIES[DraftFamily(name)]


def check_model_draft_defaults(draft_defaults: dict[str, dict[str, object]]) -> None:
    """A model file's ``draft_defaults`` name a family's section and fields it takes from there
    (conf/draft/<family>.yaml reads them); anything else would never apply: ConfigError
    naming it."""
    for section, fields in draft_defaults.items():
        where = f"model.draft_defaults.{section}"
        family = next((f for f in FAMILIES.values() if f.name.value == section), None)
        if family is None:
            names = ", ".join(f.value for f in FAMILIES)
            raise ConfigError(f"{where}: not a draft family; the families are {names}.")
        for name in fields:
            if name not in family.model_defaults:
                taken = ", ".join(family.model_defaults) or "no setting"
                raise ConfigError(
                    f"{where}.{name}: draft={section} takes {taken} from a model file; remove "
                    "it, or set it in the draft section of the command or experiment."
                )


def family_of(arch: object) -> Family:
    """The family of a draft's architecture (``formats.directory.read_architecture``'s, which
    refuses a path no layout recognises): the family of the layouts that hold it."""
    return FAMILIES[family_holding(arch)]
