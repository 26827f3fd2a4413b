"""How the bundled demo model was built (``python -m demo_model.demo`` from ``scripts/``; not in the wheel)."""
