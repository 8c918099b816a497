"""Reads AddressSanitizer/LeakSanitizer logs (ASAN_OPTIONS=log_path=...) of a
Python run with gradsync's ASan build preloaded, as `make check-asan` makes
them, and fails on what belongs to gradsync:

* any AddressSanitizer or UndefinedBehaviorSanitizer error report;
* any leak whose allocation stack passes through libgradsync or src/*/*.c.

Leaks whose stacks stay in CPython, NumPy or MPI (memory those keep until
exit by design) are counted and ignored.

    python scripts/asan_report.py build/asan/py.*
"""
import re
import sys

OURS = re.compile(r"libgradsync\.so|/src/(?:[a-z_]+/)?[a-z_]+\.c|gs_[a-z_]+ ")


def blocks(text):
    """Leak blocks ("Direct/Indirect leak of ...") and error reports."""
    parts = re.split(r"\n(?=(?:Direct|Indirect) leak of )", text)
    for p in parts:
        yield p


def main(paths):
    errors, ours, others, files = [], [], 0, 0
    for path in paths:
        try:
            text = open(path, errors="replace").read()
        except OSError:
            continue
        files += 1
        if "ERROR: AddressSanitizer:" in text or "runtime error:" in text:
            errors.append(path)
        for b in blocks(text):
            if not re.match(r"(Direct|Indirect) leak of ", b):
                continue
            if OURS.search(b):
                ours.append((path, b.strip()[:2000]))
            else:
                others += 1
    print("asan_report: %d log files, %d error reports, %d leaks through gradsync, "
          "%d leaks elsewhere (CPython, NumPy, MPI: ignored)" % (
              files, len(errors), len(ours), others))
    for p in errors:
        print("--- error report in %s" % p)
        print(open(p, errors="replace").read()[:4000])
    for p, b in ours:
        print("--- leak through gradsync in %s:\n%s" % (p, b))
    return 1 if errors or ours else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
