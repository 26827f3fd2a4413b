"""Medusa heads: the heads and drafter (:mod:`.drafter`), training (:mod:`.train`), ``train-medusa`` (:mod:`.cli`)."""
