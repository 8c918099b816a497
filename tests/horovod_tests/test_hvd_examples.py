"""Our Horovod-style training scripts (scripts/horovod/, written in the
style of Horovod's examples, not copies of them; they import
gradsync.horovod.torch) run inside this MPI job: the MNIST-style
script learns its synthetic digits, the synthetic benchmark trains a
ResNet with every rank holding the same parameters."""
import importlib.util
import os

import pytest
from hvdtest import Checks, hvd, torch

pytestmark = pytest.mark.mpi
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts",
                       "horovod")


def _load(name):
    path = os.path.join(SCRIPTS, name + ".py")
    spec = importlib.util.spec_from_file_location("hvd_example_" + name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(path) as f:
        source = f.read()
    return module, source


def _only_the_import_changed(c, source):
    code = [line for line in source.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    imports = [line for line in code if "gradsync" in line and
               line.startswith(("import ", "from "))]
    want = "import gradsync.horovod.torch as hvd   # was: import horovod.torch as hvd"
    c.check(imports == [want], f"gradsync imports: {imports}")


def test_mnist_style_script():
    c = Checks()
    mnist, source = _load("pytorch_mnist")
    _only_the_import_changed(c, source)
    loss, accuracy = mnist.main(mnist.parser.parse_args(["--epochs", "2", "--quiet"]))
    c.check(accuracy > 0.9, f"test accuracy {accuracy}")
    everyone = hvd.allgather_object((loss, accuracy))
    c.check(all(v == everyone[0] for v in everyone), f"metrics differ across ranks: {everyone}")
    c.done()


def test_synthetic_benchmark_script():
    c = Checks()
    bench, source = _load("pytorch_synthetic_benchmark")
    _only_the_import_changed(c, source)
    args = bench.parser.parse_args(["--no-cuda", "--width", "8", "--image-size", "32",
                                    "--batch-size", "4", "--num-warmup-batches", "1",
                                    "--num-batches-per-iter", "2", "--num-iters", "2"])
    model, img_secs = bench.main(args)
    c.check(len(img_secs) == 2 and all(s > 0 for s in img_secs), img_secs)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    c.check(bool(torch.isfinite(flat).all()), "parameters are finite")
    c.check(torch.equal(hvd.broadcast(flat, 0), flat), "parameters differ across ranks")
    c.done()
