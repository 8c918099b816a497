"""horovod.runner.util.threads, provided by gradsync (what Horovod's test
utilities import from it)."""
import threading

__all__ = ["in_thread"]


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Runs ``target(*args)`` on a new thread (a daemon by default) and
    returns the thread; ``silent`` swallows the target's exceptions."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args).__name__}; for a single "
                         "argument use (arg,)")

    def run(*a):
        try:
            target(*a)
        except Exception:
            if not silent:
                raise
    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
