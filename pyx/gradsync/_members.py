"""The processes of a joined world, as the rendezvous store describes them
(each rank writes ``host pid`` when it joins, a newcomer when it takes its
ticket), and whether each is gone: what shrink, grow and the joins they
make watch (docs/decisions/launch.md, "Shrinking a joined world")."""
import os
import select
import socket
import time

TICKETS = "gradsync/grow/tickets"  # the newcomers' ticket counter


class Member:
    """A member of the old world: where it lives and a handle on its process."""

    def __init__(self, text):
        host, pid = text.split()
        self.host, self.pid = host, int(pid)
        self.pidfd = None
        if self.host == socket.gethostname():
            try:  # the process itself, not whoever gets its number next
                self.pidfd = os.pidfd_open(self.pid)
            except ProcessLookupError:
                self.pidfd = -1  # already gone
            except (AttributeError, OSError):
                self.pidfd = None  # no pidfd (old kernel): /proc answers

    def gone(self):
        """Whether its process has ended (a zombie included); False when it
        lives on another host (nothing here can tell)."""
        if self.host != socket.gethostname():
            return False
        if self.pidfd == -1:
            return True
        if self.pidfd is not None:
            return bool(select.select([self.pidfd], [], [], 0)[0])
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return True

    def close(self):
        if self.pidfd is not None and self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = None


def of_world(store, generation, size):
    """The members of the world joined as ``generation``, by rank."""
    return [Member(bytes(store.get(f"gradsync/join/{generation}/proc/{r}")).decode())
            for r in range(size)]


def watch(members, ranks):
    """A join's watch: names the first of ``ranks`` whose process is gone."""
    def gone():
        for r in ranks:
            if members[r].gone():
                return f"rank {r} (pid {members[r].pid} on {members[r].host}) exited"
        return None
    return gone


def newcomers(store, first, upto, timeout):
    """The processes that took tickets ``first``..``upto`` (each writes where
    it lives just after taking its ticket: waited for, up to ``timeout``)."""
    keys = [f"gradsync/grow/want/{t}" for t in range(first, upto + 1)]
    deadline = time.monotonic() + timeout
    while not store.check(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gradsync grow: a newcomer took a ticket ({first}..{upto}) and "
                               "never said where it lives")
        time.sleep(0.005)
    return [Member(bytes(store.get(k)).decode()) for k in keys]
