"""Exit adapters (Kangaroo-style).

The adapter (:mod:`.adapter`), its training (:mod:`.train`) and ``train-adapter`` (:mod:`.cli`).
"""
