"""torch's own spawn harness (MultiProcessTestCase, which spawns every rank
itself) starting a "gradsync" world: tests/torch_tests/test_launch.py runs
this file as ``python spawn_case.py`` (torch's run_tests), outside mpiexec.

Each test's ranks join through torch's file:// or tcp:// rendezvous and
check an allreduce and an allgather against NumPy, and a plain
gs.Communicator() against torch's numbering. GS_LAUNCH_WORLD_SIZE picks the
world size (default 3).
"""
import os
import socket

# Any non-empty CI puts torch's run_tests in its CI mode, which writes XML
# reports through xmlrunner (not a dependency here; CI machines set CI).
os.environ.pop("CI", None)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import MultiProcessTestCase  # noqa: E402
from torch.testing._internal.common_utils import run_tests  # noqa: E402

import gradsync as gs  # noqa: E402
import gradsync.torch.distributed  # noqa: E402,F401  (registers "gradsync")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GradsyncSpawnTest(MultiProcessTestCase):
    @property
    def world_size(self):
        return int(os.environ.get("GS_LAUNCH_WORLD_SIZE", "3"))

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        """The rendezvous file torch's setUp made (and its .port), which
        MultiProcessTestCase leaves in TMPDIR."""
        super().tearDown()
        for path in (self.file_name, self.file_name + ".port"):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def _check(self, init_method):
        dist.init_process_group("gradsync", init_method=init_method, rank=self.rank,
                                world_size=self.world_size)
        n = self.world_size
        t = torch.arange(6, dtype=torch.float64) * (self.rank + 1) - self.rank
        dist.all_reduce(t)
        expected = sum(np.arange(6, dtype=np.float64) * (r + 1) - r for r in range(n))
        np.testing.assert_array_equal(t.numpy(), expected)
        out = [torch.empty(2, dtype=torch.int32) for _ in range(n)]
        dist.all_gather(out, torch.tensor([self.rank, 7 * self.rank], dtype=torch.int32))
        self.assertEqual([o.tolist() for o in out], [[r, 7 * r] for r in range(n)])
        with gs.Communicator() as comm:
            self.assertEqual((comm.rank, comm.size), (self.rank, n))
            x = np.full(3, float(self.rank + 1))
            comm.allreduce_(x)
            np.testing.assert_array_equal(x, np.full(3, n * (n + 1) / 2))
        dist.destroy_process_group()

    def test_file_init_method(self):
        self._check(f"file://{self.file_name}")

    def test_tcp_init_method(self):
        # every rank must agree on the port: derive it from the shared file's name
        port_file = self.file_name + ".port"
        if self.rank == 0:
            with open(port_file + ".tmp", "w") as f:
                f.write(str(_free_port()))
            os.rename(port_file + ".tmp", port_file)
        while not os.path.exists(port_file):
            pass
        with open(port_file) as f:
            port = int(f.read())
        self._check(f"tcp://127.0.0.1:{port}")


if __name__ == "__main__":
    run_tests()
