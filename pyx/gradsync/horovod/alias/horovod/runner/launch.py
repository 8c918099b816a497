"""horovod.runner.launch, provided by gradsync: horovodrun's command line
(``python -m horovod.runner.launch -np 2 python train.py``) as gradsyncrun."""
import sys

from gradsync.horovod.run import main


def run_commandline(argv=None):
    """horovodrun's entry point: parses horovodrun's arguments and runs the
    mpiexec command they stand for."""
    return main(argv)


if __name__ == "__main__":
    sys.exit(main())
