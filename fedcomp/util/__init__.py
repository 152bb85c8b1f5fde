"""Utilities every layer may use: atomic file writes (``files``), the validators of numbers and
config values (``validate``) and the optional-dependency import helper (``extras``).

Nothing here imports another fedcomp package.
"""
