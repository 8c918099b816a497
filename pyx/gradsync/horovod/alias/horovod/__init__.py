"""``horovod``, provided by gradsync (the opt-in alias of gradsync.horovod:
``python -m gradsync.horovod.alias`` prints the folder that holds it).
``import horovod.torch as hvd`` gives gradsync.horovod.torch;
``horovod.run`` starts a function on N processes under mpiexec."""
from horovod.runner import run  # noqa: F401

# The Horovod API this alias implements (Horovod 0.28.1's), marked as gradsync's.
__version__ = "0.28.1+gradsync"
__gradsync__ = True
