"""The figure table of bench.gpu's results (a dict, as its --json
writes it). Standard library only: scripts/gpu_summary.py reads this file
without importing gradsync, so a session's summary works after any step."""
import sys


def figure_rows(r):
    """(what, value, goal, check) for every figure in one bench.gpu result."""
    rows = []
    a = r.get("accumulate") or {}
    if "fraction_of_copy" in a:
        n = a.get("elements", 0)
        size = f"{n / 2**20:.0f}M" if n >= 2**20 else str(n)
        rows += [(f"(a) accumulate_ f32+=bf16 {size}, fraction of D2D copy bandwidth",
                  a["fraction_of_copy"], ">= 0.85", a["check"]),
                 ("(a) accumulate_ speed-up vs torch acc.add_(grad.float())",
                  a["speedup_vs_torch_add_cast"], "> 1", a["check"]),
                 ("(a) accumulate_ speed-up vs torch acc.add_(grad) (mixed dtype)",
                  a["speedup_vs_torch_add_mixed"], "(info)", a["check"])]
    b = r.get("bert") or {}
    for label in ("f32+=f32", "f32+=bf16"):
        if label in b:
            rows += [(f"(b) BERT-base 199 tensors {label}: speed-up vs Python add_ loop",
                      b[label]["speedup_vs_loop"], "(report)", b[label]["check"]),
                     (f"(b) BERT-base 199 tensors {label}: speed-up vs _foreach_add_",
                      b[label]["speedup_vs_foreach"], "(info)", b[label]["check"])]
    c = r.get("allreduce") or {}
    if "ratio_vs_per_tensor" in c:
        rows += [(f"(c) ResNet-50 allreduce ({c['device_transport']}), time / torch per-tensor",
                  c["ratio_vs_per_tensor"], "<= 1.05", c["check"]),
                 ("(c) ResNet-50 allreduce, time / torch flatten+1 call+unflatten",
                  c["ratio_vs_pack_unpack"], "(info)", c["check"]),
                 ("(c) ResNet-50 allreduce, time / torch 1 call on flat data",
                  c["ratio_vs_flat"], "<= 1.1" if c.get("ranks", 1) > 1 else "(info)",
                  c["check"])]
    d = r.get("train") or {}
    if "modes" in d:
        m = d["modes"]
        nan = float("nan")
        rows += [("(d) ResNet-50 step: gradsync / DDP-gloo", d["gradsync_vs_ddp_gloo"], "< 1", ""),
                 ("(d) ResNet-50 step: gradsync / compute only", m["gradsync"]["vs_compute"],
                  "(report)", ""),
                 ("(d) ResNet-50 step: DDP-gloo / compute only", m["ddp-gloo"]["vs_compute"],
                  "(report)", ""),
                 ("(d) share of comm hidden (compute+comm-step)/comm, gradsync",
                  _num(m["gradsync"]["share_of_comm_hidden"], nan), "(report)", ""),
                 ("(d) share of comm hidden (compute+comm-step)/comm, DDP-gloo",
                  _num(m["ddp-gloo"]["share_of_comm_hidden"], nan), "(report)", "")]
    e = r.get("latency") or {}
    rows += [(f"(e) allreduce {_size(x['bytes'])} latency, gradsync / torch "
              f"({x['gradsync_us']:.0f} vs {x['torch_us']:.0f} us)", x["ratio"], "<= 1.05",
              e["check"]) for x in e.get("sizes", [])]
    return rows


def _size(nbytes):
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _num(v, default):
    return default if v is None else v


def print_bench(r, out=sys.stdout):
    """The figure table, then the training and trace tables."""
    env = r.get("environment", {})
    print(f"\n== bench_gpu: {env.get('gpu', env.get('device'))}, {env.get('ranks')} rank(s), "
          f"torch {env.get('torch')}, gradsync NCCL {env.get('gradsync', {}).get('nccl')}"
          + (" (DRY RUN: the figures mean nothing)" if r.get("dry_run") else ""), file=out)
    rows = figure_rows(r)
    if rows:
        print(f"{'figure':<70} {'value':>8}  {'goal':<9} check", file=out)
    for what, v, goal, check in rows:
        print(f"{what:<70} {v:8.3f}  {goal:<9} {check}", file=out)
    for k in ("accumulate", "bert", "allreduce", "train", "latency"):
        v = r.get(k)
        if isinstance(v, dict) and ("error" in v or "skipped" in v):
            print(f"{k}: {v.get('error') or 'skipped: ' + v['skipped']}", file=out)
    d = r.get("train") or {}
    if "modes" in d:
        print_train(d, out)


TRACE_KEYS = ("backward_span_ms", "backward_busy_ms", "comm_busy_ms", "comm_in_backward_ms",
              "comm_overlap_share", "comm_overlaps_kernels_ms", "comm_lead_ms", "comm_tail_ms")


def print_train(d, out=sys.stdout):
    print(f"\n(d) training step, {d['ranks']} ranks ({d['device_transport']}), ResNet width "
          f"{d['width']} ({d['parameters']:,} parameters), batch {d['batch_per_rank']} x "
          f"{d['image']}^2 per rank; median of {d['timed_rounds']} rounds, slowest rank:",
          file=out)
    for name, m in d["modes"].items():
        print(f"  {name:<9} {1e3 * m['median_s']:9.1f} ms   {m['what']}", file=out)
    print(f"  replicas identical: {d['replicas_identical']}; gradsync vs DDP parameters after "
          f"the run: max relative difference {d['gradsync_vs_ddp_params_max_rel_diff']:.2e}",
          file=out)
    t = d.get("trace")
    if not t:
        return
    print("\n(d) trace on rank 0 (torch.profiler), median over the profiled steps; ms unless "
          "a share:", file=out)
    heads = [k[:-3] if k.endswith("_ms") else k for k in TRACE_KEYS]
    print(f"  {'mode':<9} " + " ".join(f"{h:>24}" for h in heads), file=out)
    for name, s in t.items():
        cells = [f"{'n/a':>24}" if s.get(k) is None else f"{s[k]:24.2f}" for k in TRACE_KEYS]
        print(f"  {name:<9} " + " ".join(cells), file=out)
