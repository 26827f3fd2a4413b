"""Training scripts: the bundled demo model (``python -m selfspec.training.demo``)."""
