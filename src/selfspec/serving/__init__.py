"""Front doors: the request planner, tools, grammars, the endpoint client and ``selfspec serve``.

Above :mod:`selfspec.decoding` and :mod:`selfspec.calibration`; the CLI (:mod:`selfspec.cli`) sits on top.
"""
