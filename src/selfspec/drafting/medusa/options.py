"""The Medusa drafter's option, declared in its registration (no torch: the CLI and adapters read it)."""

from __future__ import annotations

from ..declaring import DrafterOption

#: ``medusa_heads=``: a folder of heads in the published layout, or loaded heads.
MEDUSA_HEADS = DrafterOption(
    "medusa_heads",
    "with --drafter medusa: a folder of Medusa heads (default: the model's)",
    annotation="str | os.PathLike[str] | Any",
    load="selfspec.drafting.medusa.drafter:load_pickled_heads",  # imports torch when used
)

OPTIONS = (MEDUSA_HEADS,)
