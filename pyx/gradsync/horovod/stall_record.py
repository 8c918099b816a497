"""The Horovod drop-in's stalls in the flight record. Horovod matches
operations by name, so ranks that submitted different names wait for each
other in negotiation rounds that all succeed: nothing in the ring of
collectives shows the divergence. When a name has waited past the stall
warning, every member dumps its flight record and adds the operations it
has queued and not run, each with the line that submitted it, as "pending"
records (docs/GUIDE.md "When a job hangs"), which ``python -m
gradsync.doctor`` compares by name across ranks."""
import json
import logging
import time

import gradsync as gs

log = logging.getLogger("gradsync.horovod")


def pending_record(set_ranks, call, now):
    """One queued operation as a format-1 "pending" line's fields."""
    kind, args, specs, _tag = call.describe()
    return {"v": 1, "type": "pending", "set": list(set_ranks), "name": call.name, "op": kind,
            "tensors": [[dtype, list(shape)] for dtype, shape in specs],
            "redop": str(args["op"]) if args.get("op") is not None else None,
            "root": args.get("root"), "age": round(now - call.submitted, 3),
            "site": call.site}


def write(set_ranks, calls, reason):
    """Dumps this rank's flight record with ``calls`` (queued, not run)
    added; returns the file, or None with the recorder off or the dump
    refused (said once as a warning: a stall report must not end the job)."""
    if gs.flight_record_capacity() <= 0:
        return None
    try:
        path = gs.dump_flight_record(reason)
        now = time.monotonic()
        with open(path, "a", encoding="utf-8") as f:
            for call in calls:
                f.write(json.dumps(pending_record(set_ranks, call, now)) + "\n")
        return path
    except (OSError, gs.Error) as exc:
        log.warning("gradsync.horovod: could not write the flight record of a stall: %s", exc)
        return None
