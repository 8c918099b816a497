"""Reduction ops: ``Op`` is built from the C library's table (gs_op_name
through gradsync._core.OPS), so names and codes have one source."""
import enum

from gradsync import _core

Op = enum.IntEnum("Op", {name.upper(): code for name, code in _core.OPS.items()},
                  module=__name__)
Op.__doc__ = ("Reduction ops; the string names (\"sum\", ...) are accepted everywhere too. "
              "ADASUM_HIERARCHICAL is also op=\"adasum\" with adasum=\"hierarchical\".")
