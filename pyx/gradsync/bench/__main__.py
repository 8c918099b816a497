"""``python -m gradsync.bench``."""
import sys

from gradsync.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
