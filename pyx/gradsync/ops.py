"""Reduction ops."""
import enum


class Op(enum.IntEnum):
    """Reduction ops; the string names ("sum", ...) are accepted everywhere too."""

    SUM = 0
    AVERAGE = 1
    MIN = 2
    MAX = 3
    PROD = 4
    ADASUM = 5
    ADASUM_HIERARCHICAL = 6  # also op="adasum" with adasum="hierarchical"
