"""The engine and its round: options, config, generation, loop, verify, controller, batching.

Above :mod:`selfspec.drafting` (it runs drafters) and below :mod:`selfspec.calibration`, which it
reaches through one lazy edge only: first-load calibration from ``from_pretrained``.
"""
