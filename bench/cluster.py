"""Allreduce across simulated hosts: time and bytes per host link.

Run inside scripts/simcluster (the data link's counters are read from
/sys/class/net/$SIMCLUSTER_DATA_IFACE in each host's namespace):

    scripts/simcluster --hosts 2 --ranks-per-host 2 --rate 10gbit -- \\
        python -m bench.cluster --json cluster.json

Cases (--cases): ResNet-50's gradient list (161 float32 tensors, 97.5 MiB)
and one 64 MiB float32 tensor by default; any size for one tensor. Variants,
on the same buffers, interleaved in every repeat so outside load hits them
alike:

    gs flat     gradsync with GRADSYNC_HIERARCHICAL=0
    gs hier     gradsync with GRADSYNC_HIERARCHICAL=1
    gs hier mpi-host  the same with GRADSYNC_CMA_BYTES=0: its host stages
                through MPI instead of reading the peers' memory
    gs default  gradsync as it chooses (GRADSYNC_HIERARCHICAL unset)
    mpi4py      one mpi4py Allreduce(IN_PLACE) per tensor
    mpi4py fused  one mpi4py Allreduce of one buffer holding every tensor
    gs <wire>   gradsync as it chooses, in a low-precision wire format
                (--wires bfloat16,float8_e4m3: issue 32's benchmark)

--variants keeps only the named ones (comma list).

Time: the slowest rank's, median over --repeats. Bytes: what each host's
data link sent during the timed calls, per call (the largest host's).
"""
import argparse
import os
import statistics

import numpy as np
from mpi4py import MPI

import gradsync as gs
from gradsync.bench.args import parse_size
from gradsync.bench.data import load_shapes
from gradsync.bench.output import write_json
from gradsync.bench.timing import interleaved, timed

WORLD = MPI.COMM_WORLD


def link_bytes():
    """This host's data-link bytes sent so far, or None outside simcluster."""
    iface = os.environ.get("SIMCLUSTER_DATA_IFACE")
    if not iface:
        return None
    with open("/sys/class/net/%s/statistics/tx_bytes" % iface) as f:
        return int(f.read())


def communicator(mode, **env):
    """A Communicator made with GRADSYNC_HIERARCHICAL=mode (None: unset) and
    the other GRADSYNC_<NAME>=value of env (read when it is made)."""
    names = {"GRADSYNC_HIERARCHICAL": mode}
    names.update({"GRADSYNC_" + k.upper(): str(v) for k, v in env.items()})
    old = {k: os.environ.pop(k, None) for k in names}
    os.environ.update({k: v for k, v in names.items() if v is not None})
    try:
        return gs.Communicator()
    finally:
        for k, v in old.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


def variants(tensors, flat, wires=()):
    # "gs hier mpi-host": the host stages through MPI, not the peers' memory
    comms = {"gs flat": communicator("0"), "gs hier": communicator("1"),
             "gs hier mpi-host": communicator("1", cma_bytes=0),
             "gs default": communicator(None)}
    fns = {name: (lambda c=c: c.allreduce_(tensors)) for name, c in comms.items()}
    for w in wires:
        fns["gs " + w] = lambda w=w: comms["gs default"].allreduce_(tensors, wire=w)

    def per_tensor():
        for t in tensors:
            WORLD.Allreduce(MPI.IN_PLACE, t)
    fns["mpi4py"] = per_tensor
    fns["mpi4py fused"] = lambda: WORLD.Allreduce(MPI.IN_PLACE, flat)
    return fns, comms


def measure(fns, warmup, repeats, iters):
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=WORLD.rank)
    leader = node.rank == 0
    node.Free()

    def sample(fn, comm, iters):
        """(seconds per call, the busiest host link's bytes per call or None)."""
        b0 = link_bytes() if leader else None
        dt = timed(fn, comm, iters)
        sent = None if b0 is None else (link_bytes() - b0) / iters
        per_host = [b for b in comm.allgather(sent) if b is not None]
        return dt, max(per_host) if per_host else None

    samples = interleaved(fns, WORLD, warmup, repeats, iters, sample=sample)
    out = {}
    for name, pairs in samples.items():
        times = [t for t, _ in pairs]
        b = [x for _, x in pairs if x is not None]
        out[name] = {"time_s": statistics.median(times), "samples_s": times,
                     "bytes_per_host": statistics.median(b) if b else None}
    return out


def case_tensors(case):
    rng = np.random.default_rng(WORLD.rank)
    if case == "resnet50":
        shapes, _ = load_shapes("resnet50")
        counts = [int(np.prod(s)) for s in shapes]
    else:  # one tensor of that many bytes: 64M, 256K, ...
        counts = [max(1, parse_size(case) // 4)]
    flat = (rng.standard_normal(sum(counts)) * 1e-3).astype(np.float32)
    tensors, at = [], 0
    for n in counts:  # separate allocations, as a model's gradients are
        tensors.append(flat[at:at + n].copy())
        at += n
    return tensors, flat


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="resnet50,64M",
                   help="comma list: resnet50, or one float32 tensor of a size (64M, 256K)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--wires", default="", help="comma list of wire formats to add")
    p.add_argument("--variants", default="", help="comma list: only these variants")
    args = p.parse_args()
    hosts = int(os.environ.get("SIMCLUSTER_HOSTS", "1"))
    rate = int(os.environ.get("SIMCLUSTER_RATE", "0"))
    results = {}
    for case in args.cases.split(","):
        tensors, flat = case_tensors(case)
        fns, comms = variants(tensors, flat, [w for w in args.wires.split(",") if w])
        if args.variants:
            keep = args.variants.split(",")
            fns = {k: f for k, f in fns.items() if k in keep}
        results[case] = measure(fns, args.warmup, args.repeats, args.iters)
        results[case]["_bytes"] = int(flat.nbytes)
        for c in comms.values():
            c.close()
    if WORLD.rank == 0:
        print("%d ranks, %d hosts, links %s bit/s, median of %d" % (
            WORLD.size, hosts, "{:,}".format(rate) if rate else "?", args.repeats))
        for case, rows in results.items():
            nbytes = rows["_bytes"]
            base = "mpi4py" if "mpi4py" in rows else next(k for k in rows if k != "_bytes")
            print("\n%s (%.1f MiB)" % (case, nbytes / 2 ** 20))
            mpi = rows[base]["time_s"]
            print("  %-17s %10s %14s %8s %9s" % ("variant", "time(ms)", "sent/host(MB)",
                                                 "x msg", base[:8] + "/x"))
            for name, r in rows.items():
                if name.startswith("_"):
                    continue
                b = r["bytes_per_host"]
                print("  %-17s %10.1f %14s %8s %9.2f" % (
                    name, r["time_s"] * 1e3, "-" if b is None else "%.1f" % (b / 1e6),
                    "-" if b is None else "%.2f" % (b / nbytes), mpi / r["time_s"]))
        if args.json:
            write_json(args.json, {"ranks": WORLD.size, "hosts": hosts, "rate_bit_s": rate,
                                   "repeats": args.repeats, "results": results})


if __name__ == "__main__":
    main()
