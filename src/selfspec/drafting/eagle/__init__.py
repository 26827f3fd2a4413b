"""EAGLE-style feature heads: the head, published layouts, the drafter, training, prompts and ``train-eagle``.

:mod:`.head` is the model, :mod:`.published` reads SafeAILab's EAGLE-1/2 layout, :mod:`.drafter`
drafts chains and EAGLE-2 trees (and registers ``drafter="eagle"`` / ``"eagle_hybrid"``),
:mod:`.train` self-distils a head, :mod:`.prompts` holds its prompt mix, :mod:`.cli` adds
``selfspec train-eagle``.
"""
