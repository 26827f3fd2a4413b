"""Pure maths, no model and no I/O: sampling, acceptance, constraints, token trees, the speed model.

The innermost ring: it imports only :mod:`selfspec.errors`. Everything here takes tensors and
numbers and is tested on its own.
"""
