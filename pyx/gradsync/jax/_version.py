"""The JAX versions gradsync.jax supports, checked at its import: its
lowering inside jax.jit uses jax.ffi (public from 0.5) and JAX's ordered
effects, which have no public API (docs/decisions/jax.md)."""
import re

# [oldest, first unsupported)
SUPPORTED_JAX = ((0, 5), (0, 11))


def version_problem(version):
    """None when JAX `version` ("0.10.2") is supported, else why not."""
    numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    (lo, hi) = SUPPORTED_JAX
    if lo <= numbers < hi:
        return None
    return (f"gradsync.jax supports JAX {lo[0]}.{lo[1]} up to (not including) {hi[0]}.{hi[1]}, "
            f"found JAX {version}: install a JAX in that range (pip install 'jax>={lo[0]}.{lo[1]},"
            f"<{hi[0]}.{hi[1]}'), or a gradsync made for your JAX")
