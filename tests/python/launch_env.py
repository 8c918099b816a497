"""The environment of a process started the way torchrun starts its ranks
(MPI singletons joined through a rendezvous): nothing an MPI launcher or an
outer torch rendezvous put there, gradsync's package and the given folders
importable, a timeout so a hang is an error, one OpenMP thread. Imports
only os (the framework suites use it without initializing MPI)."""
import os

_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "MPI_LOCAL", "OMPI_", "MPIR_")
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TOP = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def singleton_env(*paths, **extra):
    """os.environ less the launcher's and the rendezvous' variables, with
    the checkout's pyx/ and ``paths`` first on PYTHONPATH and ``extra`` set."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_LAUNCHER_PREFIXES) and k not in _RENDEZVOUS}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(TOP, "pyx"), *paths] +
                                        [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.setdefault("GRADSYNC_TIMEOUT_SECONDS", "120")
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env
