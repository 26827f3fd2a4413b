"""The exit adapter's option, declared by the drafters that use one (no torch: the CLI and adapters read it)."""

from __future__ import annotations

from ..declaring import DrafterOption

#: ``exit_adapter=``: a trained adapter folder, a loaded one, or ``"auto"``. Not exclusive:
#: :func:`~selfspec.drafting.exit_adapter.adapter.engine_exit_adapter` decides (a saved adapter
#: found by ``"auto"`` is left out where the drafter does not use it).
EXIT_ADAPTER = DrafterOption(
    "exit_adapter",
    "a trained exit adapter folder for early_exit/hybrid, or 'auto'",
    annotation="str | os.PathLike[str] | Any",
    exclusive=False,
)

OPTIONS = (EXIT_ADAPTER,)
