"""``python -m gradsync.horovod.alias`` prints the alias folder (for PYTHONPATH)."""
import sys

from gradsync.horovod.alias import folder

sys.stdout.write(folder() + "\n")
