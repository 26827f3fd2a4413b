"""The EAGLE drafters' options, declared in their registration (no torch: the CLI and adapters read them)."""

from __future__ import annotations

from ..declaring import DrafterOption, check_switch

#: ``eagle_head=``: the head's folder, a loaded head, or ``"auto"`` (resolved by the drafter).
EAGLE_HEAD = DrafterOption(
    "eagle_head",
    "with --drafter eagle or eagle_hybrid: an EAGLE head folder, or 'auto' (the model's)",
    annotation="str | os.PathLike[str] | Any",
)
#: ``learn_online=``: keep training the head on served text (the drafter ``"auto"`` declares it too).
LEARN_ONLINE = DrafterOption(
    "learn_online",
    "keep training the EAGLE head on the text it serves, in a background thread (drafter eagle, "
    "eagle_hybrid, or auto choosing one); the text never changes (docs/online_learning.md)",
    default=False,
    annotation="bool",
    text_type=bool,
    check=check_switch("learn_online"),
)

OPTIONS = (EAGLE_HEAD, LEARN_ONLINE)
