"""torch.compile never traces the backend's collectives (issue 46).

torch reaches a process group's collectives from C++ (c10d's dispatch:
gloo's and NCCL's are C++ and never seen by Dynamo), but a Python group's
methods met inside a compiled region (DDP rebuilding its buckets on the
second step calls broadcast) were traced, and Dynamo stopped at the first
member it could not model ("Attempted to access unregistered member on an
OpaqueObject ... '_run'"). Each collective is wrapped in
``torch.compiler.disable`` so that it runs eagerly, as a C++ backend's does.

The wrapping waits for Dynamo: ``torch.compiler.disable`` imports
``torch._dynamo``, 2-5 s per process, which a job that never compiles
should not pay (torch's own test harness starts hundreds of processes).
Dynamo is imported before it traces anything (``torch.compile`` imports
it), so wrapping right after its import is early enough: a hook on the
import system does it then, or at once when Dynamo is already loaded.
"""
import importlib.abc
import importlib.util
import sys

DYNAMO = "torch._dynamo"


def eager_under_compile(cls, names):
    """Make ``cls``'s methods ``names`` run eagerly inside compiled regions,
    now if Dynamo is loaded, else as soon as it is."""
    def wrap():
        import torch
        for name in names:
            method = getattr(cls, name)
            if not getattr(method, "_torchdynamo_disable", False):
                setattr(cls, name, torch.compiler.disable(method, recursive=True))

    if DYNAMO in sys.modules:
        wrap()
    else:
        sys.meta_path.insert(0, _AfterImport(DYNAMO, wrap))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``then()`` right after module ``name`` has executed, once."""

    def __init__(self, name, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and the lookup below must not find us
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute, then = spec.loader.exec_module, self.then

        def exec_module(module):
            execute(module)
            then()
        spec.loader.exec_module = exec_module
        return spec
