"""gradsync-doctor DIR (or python -m gradsync.doctor DIR): reads the flight
records the ranks of a job wrote (rank-<N>.jsonl, format 1: docs/GUIDE.md
"When a job hangs") and says, first, in one sentence, which rank and call
made the job hang or fail, then the evidence: per communicator the call each
rank reached, the first call where ranks disagree, the ranks that never
entered a call the others wait in, calls entered everywhere but not
completed, ranks that left no dump.

Standard library only (it runs without MPI: `python path/to/doctor.py DIR`
works too). The exit status tells the class of problem: 0 nothing wrong
found, 1 no dumps, 2 a rank never called a collective the others wait in,
3 ranks disagree on a call, 4 a call entered everywhere never completed (a
transport or network fault), 5 ranks left no dump and the others wait."""
import glob
import json
import os
import sys

FORMAT = 1
OK, NO_DUMPS, NEVER_CALLED, MISMATCH, STUCK, MISSING = 0, 1, 2, 3, 4, 5
# calls whose element counts may differ by rank
VARYING = {"allgather", "allgatherv", "alltoall_counts", "alltoallv", "gather", "scatter",
           "allgather (rows)", "reduce_scatter", "allgather_shards", "reduce_scatter_shards"}
LIBRARY_MARKS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen")


class Rank:
    """One rank's dump."""

    def __init__(self, path):
        self.path = path
        self.header, self.comms, self.sites, self.calls = {}, {}, {}, []
        self.pending = []  # Horovod drop-in: operations queued and not run
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line cut short: the rest still counts
                if rec.get("v") != FORMAT:
                    continue
                kind = rec.get("type")
                if kind == "header":
                    self.header = rec
                elif kind == "comm":
                    self.comms[rec["comm"]] = rec
                elif kind == "site":
                    self.sites[rec["site"]] = rec["stack"]
                elif kind == "call":
                    self.calls.append(rec)
                elif kind == "pending":
                    self.pending.append(rec)
        self.rank = self.header.get("rank", -1)
        self.calls.sort(key=lambda c: c["id"])

    def ago(self, t):
        """Seconds between monotonic time t and this dump."""
        return self.header.get("clock", t) - t

    def site(self, call, full=False):
        text = self.sites.get(call.get("site", -1))
        if not text:
            return ""
        lines = text.split("\n")
        if full:
            return lines
        for ln in lines:
            if not any(m in ln for m in LIBRARY_MARKS):
                return short_line(ln)
        return short_line(lines[0])


def short_line(frame):
    """'/a/b/train.py:88 in step' -> 'train.py:88'."""
    where = frame.split(" in ")[0]
    return os.path.basename(where)


def describe(call):
    """'allreduce float32[100] sum', 'broadcast int32[3] root 1', 'recv from 0 tag 5'."""
    op = call["op"]
    if call.get("p2p"):
        peer = call["root"]
        way = "to" if "send" in op else "from"
        peer = "any rank" if peer < 0 else "rank %d" % peer
        return "%s %s[%d] %s %s tag %d" % (op, call["dtype"] or "?", call["count"], way, peer,
                                          call.get("tag", 0))
    text = op
    if call["n"]:
        text += " %s[%d]" % (call["dtype"] or "?", call["count"])
        if call["n"] > 1:
            text += " (+%d more tensors)" % (call["n"] - 1)
    if op in ("allreduce", "reduce", "reduce_scatter", "reduce_scatter_shards"):
        text += " " + call["redop"]
    if op in ("broadcast", "reduce", "gather", "scatter"):
        text += " root %d" % call["root"]
    return text


def signature(call):
    sig = (call["op"], call["dtype"], call["n"], call["redop"] if "reduce" in call["op"] else "",
           call["root"] if call["op"] in ("broadcast", "reduce", "gather", "scatter") else 0)
    if call["op"] not in VARYING:
        sig += (call["count"],)
    return sig


def fmt_ranks(ranks):
    ranks = sorted(ranks)
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else "%d-%d" % (ranks[i], ranks[j]))
        i = j + 1
    return ",".join(out)


class Comm:
    """One communicator, as every rank that dumped saw it."""

    def __init__(self, uid, label):
        self.uid, self.label = uid, label
        self.members = None  # world ranks, when known in full
        self.by_rank = {}    # world rank -> {seq: call} (collectives only)
        self.last = {}       # world rank -> last seq entered (the comm table's)
        self.freed = set()   # world ranks that freed it (nobody waits on it there)

    def reached(self, r):
        return self.last.get(r, max(self.by_rank.get(r) or {0: None}))


def load(directory):
    ranks = {}
    for path in sorted(glob.glob(os.path.join(directory, "rank-*.jsonl"))):
        rk = Rank(path)
        if rk.header:
            ranks[rk.rank] = rk
    return ranks


def gather_comms(ranks):
    comms = {}
    world = max((rk.header.get("world_size", 0) for rk in ranks.values()), default=0)
    for r, rk in ranks.items():
        local = {}
        for idx, c in rk.comms.items():
            full = len(c["ranks"]) == c["size"]
            is_world = full and c["size"] == world and c["ranks"] == list(range(world))
            ordinal = c["uid"].split(".")[1]
            label = ("WORLD" if ordinal == "0" else "WORLD#" + ordinal) if is_world else (
                "communicator %s of ranks %s" % (c["uid"].split(".")[0][:6] + "." +
                                                 c["uid"].split(".")[1], fmt_ranks(c["ranks"])))
            cm = comms.setdefault(c["uid"], Comm(c["uid"], label))
            if full:
                cm.members = c["ranks"]
            cm.last[r] = c["last_seq"]
            if c.get("freed"):
                cm.freed.add(r)
            cm.by_rank.setdefault(r, {})
            local[idx] = cm
        for call in rk.calls:
            cm = local.get(call["comm"])
            if cm is not None and not call.get("p2p"):
                cm.by_rank[r][call["seq"]] = call
    return comms, world


def newest_call(cm):
    """The latest call id any rank recorded on cm (ids order one rank's calls)."""
    return max((max(c["id"] for c in calls.values()) for calls in cm.by_rank.values() if calls),
               default=0)


def disagreement(cm):
    """(seq, {rank: call}) of the disagreement to report on cm: the newest
    call recorded on every rank that gradsync failed as a mismatch and that
    no call completed on every rank followed (the ranks stay in step after
    one, so an older one was survived and the newest is what the dump is
    about); else, with the check off, the first call recorded on every rank
    with differing signatures (the later ones follow from it)."""
    ranks = sorted(cm.by_rank)
    if not ranks:
        return None
    seqs = sorted(set().union(*(set(cm.by_rank[r]) for r in ranks)))
    everywhere = [(s, {r: cm.by_rank[r][s] for r in ranks}) for s in seqs
                  if all(s in cm.by_rank[r] for r in ranks)]
    # one the ranks went on from (a later call completed on every rank) was
    # survived: the Horovod drop-in, for one, negotiates after every
    # mismatch of submission order
    survived = max((s for s, calls in everywhere
                    if all(c["status"] == "ok" for c in calls.values())), default=0)
    detected = [(s, calls) for s, calls in everywhere if s > survived and
                any(c["status"] == "mismatch" for c in calls.values())]
    if detected:
        return detected[-1]
    for s, calls in everywhere:
        if len({signature(c) for c in calls.values()}) > 1 and \
                not any(c["status"] == "mismatch" for c in calls.values()):
            return s, calls
    return None


# a call's statuses that mean the rank was waiting in it at its dump, or
# until the wait gave up (a timeout, an interrupt, a peer's process gone)
WAITED = ("in_flight", "timeout", "interrupted", "peer_lost")


def latest(rk):
    return rk.calls[-1] if rk.calls else None


def doing_now(rk, comms_of_rank):
    """What a rank is doing at its dump: the call in flight, or its own code."""
    last = latest(rk)
    if last is None:
        return "it made no gradsync call"
    where = rk.site(last)
    at = " at " + where if where else ""
    if last["status"] in WAITED:
        return "it was waiting in %s%s on %s" % (describe(last), at, comms_of_rank(last))
    return ("its last call was %s #%d%s (completed %.1f s before its dump), so it is in its "
            "own code" % (describe(last), last["seq"], at,
                          rk.ago(last["t_done"] or last["t_enter"])))


class Report:
    def __init__(self):
        self.verdict, self.code, self.evidence = None, OK, []

    def say(self, line=""):
        self.evidence.append(line)


def diagnose(directory):
    rep = Report()
    ranks = load(directory)
    if not ranks:
        rep.verdict, rep.code = "no flight records (rank-*.jsonl) in %s" % directory, NO_DUMPS
        return rep
    comms, world = gather_comms(ranks)
    missing = sorted(set(range(world)) - set(ranks)) if world else []

    def comm_name(rank, call):
        for idx, c in ranks[rank].comms.items():
            if idx == call["comm"]:
                return comms[c["uid"]].label
        return "?"

    rep.say("%d dump(s) in %s: ranks %s of %d%s" % (
        len(ranks), directory, fmt_ranks(ranks), world,
        "; no dump from ranks %s" % fmt_ranks(missing) if missing else ""))
    for r in sorted(ranks):
        rep.say("  rank %d (%s pid %s): %s" % (r, ranks[r].header.get("host"),
                                             ranks[r].header.get("pid"),
                                             ranks[r].header.get("reason")))
    for cm in comms.values():
        evidence_of_comm(rep, cm, ranks)
    # the newest problem first: a dump holds the calls of communicators long
    # gone too; one every rank freed is waited on by nobody
    judge_pending(rep, ranks)
    order = sorted(comms.values(), key=newest_call, reverse=True)
    for cm in order:
        if rep.verdict is None:
            judge_mismatch(rep, cm, ranks)
    for cm in order:
        if rep.verdict is None and not (cm.freed and cm.freed >= set(cm.by_rank)):
            judge_hang(rep, cm, ranks, missing, lambda rk, c: comm_name(rk.rank, c))
    if rep.verdict is None:
        rep.verdict = "no hang or disagreement found: every rank completed its last call"
        if missing:
            rep.verdict += " (ranks %s left no dump)" % fmt_ranks(missing)
    return rep


def evidence_of_comm(rep, cm, ranks):
    rep.say("")
    rep.say("%s:" % cm.label)
    for r in sorted(cm.by_rank):
        s = cm.reached(r)
        call = cm.by_rank[r].get(s)
        if s == 0:
            rep.say("  rank %d made no collective on it" % r)
            continue
        if call is None:
            rep.say("  rank %d reached #%d (not in its ring)" % (r, s))
            continue
        where = ranks[r].site(call)
        rep.say("  rank %d reached #%d %s: %s%s" % (r, s, describe(call), call["status"],
                                                   " at " + where if where else ""))


def show_stacks(rep, ranks, calls):
    for r, call in sorted(calls.items()):
        lines = ranks[r].site(call, full=True)
        if lines:
            rep.say("  rank %d's stack:" % r)
            for ln in lines:
                rep.say("      " + ln)


def judge_mismatch(rep, cm, ranks):
    found = disagreement(cm)
    if not found:
        return
    s, calls = found
    groups = {}
    for r, c in calls.items():
        groups.setdefault(signature(c), []).append(r)
    parts = []
    for _sig, rs in sorted(groups.items(), key=lambda kv: min(kv[1])):
        c = calls[rs[0]]
        where = ranks[rs[0]].site(c)
        parts.append("rank%s %s %s%s" % ("s" if len(rs) > 1 else "", fmt_ranks(rs), describe(c),
                                         " at " + where if where else ""))
    rep.verdict = "ranks disagree at call #%d on %s: %s" % (s, cm.label, " vs ".join(parts))
    rep.code = MISMATCH
    rep.say("")
    rep.say("disagreement: #%d on %s" % (s, cm.label))
    for r, c in sorted(calls.items()):
        rep.say("  rank %d: %s (%s)" % (r, describe(c), c["status"]))
    show_stacks(rep, ranks, calls)


def describe_pending(rec):
    """'allreduce.metric float32[3] sum' for a Horovod drop-in's queued operation."""
    tensors = rec.get("tensors") or []
    text = rec["name"]
    if tensors:
        dtype, shape = tensors[0]
        text += " %s[%s]" % (dtype, ",".join(str(d) for d in shape))
        if len(tensors) > 1:
            text += " (+%d more tensors)" % (len(tensors) - 1)
    if rec.get("redop"):
        text += " " + rec["redop"]
    if rec.get("root") is not None:
        text += " root %s" % rec["root"]
    return text


def judge_pending(rep, ranks):
    """The Horovod drop-in matches operations by name: names some members
    queued and others never submitted stall them all while every
    collective succeeds. From the "pending" records its stall report adds,
    per process set: which ranks queued which name where, and which did
    not (a rank that queued nothing the others lack is in its own code)."""
    sets = {}
    for r, rk in ranks.items():
        for rec in rk.pending:
            sets.setdefault(tuple(rec["set"]), {}).setdefault(r, {})[rec["name"]] = rec
    for members, by_rank in sorted(sets.items()):
        dumped = [r for r in members if r in ranks]
        names = sorted(set().union(*by_rank.values()),
                       key=lambda n: -max(q[n]["age"] for q in by_rank.values() if n in q))
        parts, lacking = [], set()
        for name in names:
            holders = [r for r in dumped if name in by_rank.get(r, {})]
            absent = [r for r in dumped if r not in holders]
            if not absent:
                continue
            lacking.update(absent)
            rec = by_rank[holders[0]][name]
            where = ranks[holders[0]].site(rec)
            parts.append("rank%s %s queued %s%s, which rank%s %s never submitted" % (
                "s" if len(holders) > 1 else "", fmt_ranks(holders), describe_pending(rec),
                " at " + where if where else "", "s" if len(absent) > 1 else "",
                fmt_ranks(absent)))
        if not parts:
            continue
        idle = sorted(r for r in lacking if not by_rank.get(r))
        rep.verdict = ("Horovod operations differ by name on process set %s: %s; the ranks wait "
                       "for each other (a stall)" % (fmt_ranks(list(members)),
                                                     "; ".join(parts[:3])))
        if idle:
            rep.verdict += "; rank%s %s queued nothing (in its own code)" % (
                "s" if len(idle) > 1 else "", fmt_ranks(idle))
        rep.code = NEVER_CALLED if idle else MISMATCH
        rep.say("")
        rep.say("Horovod operations queued and not run, process set %s:" % fmt_ranks(list(members)))
        for r in dumped:
            for _name, rec in sorted(by_rank.get(r, {}).items()):
                rep.say("  rank %d: %s, queued %.1f s before its dump" % (
                    r, describe_pending(rec), rec["age"]))
                show_stacks(rep, ranks, {r: rec})
        return


def judge_hang(rep, cm, ranks, missing, comm_name):
    if not cm.by_rank:
        return
    top = max(cm.reached(r) for r in cm.by_rank)
    waiting = {r: cm.by_rank[r][top] for r in cm.by_rank
               if cm.reached(r) == top and top in cm.by_rank[r]
               and cm.by_rank[r][top]["status"] in WAITED}
    if not waiting:
        return
    call = next(iter(waiting.values()))
    late = sorted(r for r in cm.by_rank if cm.reached(r) < top)
    members = cm.members if cm.members is not None else sorted(set(cm.by_rank) | set(missing))
    absent = sorted(r for r in missing if r in members)
    what = "%s #%d on %s" % (call["op"], top, cm.label)
    cut_off = left_behind(cm, late)
    if cut_off:
        s, done_on = cut_off
        c = cm.by_rank[late[0]][s]
        rep.verdict = ("%s #%d on %s completed on ranks %s but never on ranks %s, which still "
                       "wait in it (the others went on to #%d): its data never reached them, "
                       "a transport or network fault, not the program" % (
                           c["op"], s, cm.label, fmt_ranks(done_on), fmt_ranks(late), top))
        rep.code = STUCK
        show_stacks(rep, ranks, {r: cm.by_rank[r][s] for r in late})
        return
    if late:
        rk = ranks[late[0]]
        w0 = min(waiting)
        wsite = ranks[w0].site(waiting[w0])
        rep.verdict = "rank%s %s never called %s (%s in it%s); rank %d: %s" % (
            "s" if len(late) > 1 else "", fmt_ranks(late), what, waiters(waiting),
            " at " + wsite if wsite else "", late[0], doing_now(rk, lambda c: comm_name(rk, c)))
        prev = cm.by_rank[late[0]].get(cm.reached(late[0]))
        if prev is not None and prev is not latest(rk):
            psite = rk.site(prev)
            rep.verdict += "; its last call on %s was %s #%d%s" % (
                cm.label, prev["op"], prev["seq"], " at " + psite if psite else "")
        rep.code = NEVER_CALLED
        rep.say("")
        rep.say("stragglers on %s (never entered #%d):" % (cm.label, top))
        for r in late:
            now = doing_now(ranks[r], lambda c, r=r: comm_name(ranks[r], c))
            rep.say("  rank %d: %s" % (r, now))
            last = latest(ranks[r])
            if last is not None:
                show_stacks(rep, ranks, {r: last})
    elif absent:
        rep.verdict = ("rank%s %s left no dump (dead, or its host is down) and %s in %s"
                       % ("s" if len(absent) > 1 else "", fmt_ranks(absent), waiters(waiting),
                          what))
        rep.code = MISSING
    else:
        slow = slowest_phase(waiting)
        rep.verdict = ("%s was entered by every rank but never completed (stuck %s): a transport "
                       "or network fault, not the program" % (what, slow))
        rep.code = STUCK
    show_stacks(rep, ranks, waiting)


def left_behind(cm, late):
    """(seq, ranks that completed it) when every late rank waits in one
    earlier call that the other ranks completed with the same signature:
    the late ranks did call it, so the program is not at fault (a root's
    broadcast or a send can finish before its data arrives). Else None."""
    if not late:
        return None
    seqs = {cm.reached(r) for r in late}
    if len(seqs) != 1:
        return None
    s = seqs.pop()
    mine = [cm.by_rank[r].get(s) for r in late]
    if any(c is None or c["status"] not in WAITED
           for c in mine):
        return None
    done_on = sorted(r for r in cm.by_rank if r not in late and s in cm.by_rank[r]
                     and cm.by_rank[r][s]["status"] == "ok")
    if not done_on or len({signature(c) for c in mine} |
                          {signature(cm.by_rank[r][s]) for r in done_on}) != 1:
        return None
    return s, done_on


def waiters(ranks):
    return ("rank %s waits" if len(ranks) == 1 else "ranks %s wait") % fmt_ranks(ranks)


def slowest_phase(calls):
    """Where the ranks' call stopped: before validation ended, or in the data."""
    if all(c["t_sent"] for c in calls.values()):
        return "moving data after validation on ranks %s" % fmt_ranks(calls)
    stuck = [r for r, c in calls.items() if not c["t_valid"]]
    return "in validation on ranks %s" % fmt_ranks(stuck or calls)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: gradsync-doctor DIR\n\n" + __doc__)
        return NO_DUMPS if argv and argv[0] not in ("-h", "--help") else OK
    rep = diagnose(argv[0])
    print(rep.verdict)
    if rep.evidence:
        print()
        print("\n".join(rep.evidence))
    return rep.code


if __name__ == "__main__":
    sys.exit(main())
