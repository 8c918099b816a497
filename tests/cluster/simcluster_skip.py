"""What the plain-pytest cluster tests (test_cluster_faults.py,
test_cluster_elastic.py) share: where scripts/simcluster is, and a skip
mark, with simcluster's reason, where no simulated cluster can be made."""
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
SIMCLUSTER = os.path.join(ROOT, "scripts", "simcluster")


def _cluster_possible():
    r = subprocess.run([sys.executable, SIMCLUSTER, "--check"], capture_output=True, text=True)
    return r.returncode == 0, r.stderr.strip()


POSSIBLE, WHY = _cluster_possible()
needs_simcluster = pytest.mark.skipif(not POSSIBLE, reason=WHY)
