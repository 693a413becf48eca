"""PSClient.close() while its heartbeat thread is between two shards' beats: the thread ends quietly.

The first shard's stub is replaced by one whose Heartbeat runs close() (as the training thread
does when the job ends) — the race that left "Cannot invoke RPC on closed channel!" tracebacks
from the heartbeat thread at large worker counts. The second stub is the client's own, on a real
(closed) gRPC channel.
"""

import subprocess
import sys

from hybridfleet.ps.worker.client import ClientSecurity, PSClient


class _ClosingStub:
    def __init__(self, client: PSClient):
        self.client = client
        self.calls = 0

    def Heartbeat(self, *_args, **_kwargs):
        self.calls += 1
        self.client.close(leave=False)


def test_a_heartbeat_racing_close_ends_the_loop_without_calling_a_closed_channel():
    client = PSClient(["127.0.0.1:9", "127.0.0.1:9"], ClientSecurity(insecure=True), "site-0", "site", 0)
    closing = _ClosingStub(client)
    client._stubs[0] = closing
    client._heartbeat_loop(0.001)  # returns instead of raising ValueError from the closed second channel
    assert closing.calls == 1 and client._hb_stop.is_set()


def test_a_closed_channel_outside_close_is_still_an_error():
    client = PSClient(["127.0.0.1:9"], ClientSecurity(insecure=True), "site-0", "site", 0)
    for channel in client._channels:
        channel.close()  # closed, but the client never asked to stop: that is a bug, not a quiet exit
    try:
        client._heartbeat_loop(0.001)
    except ValueError as err:
        assert "closed channel" in str(err)
    else:
        raise AssertionError("the heartbeat loop hid a closed channel it was not told about")
    finally:
        client._hb_stop.set()
        client._pool.shutdown(wait=False)


def test_a_worker_that_left_exits_without_the_final_cyclic_collection():
    # The first atexit hook runs last: by then the objects alive at exit are frozen, once.
    code = ("import atexit, gc; atexit.register(lambda: print(gc.get_freeze_count() > 0)); "
            "from hybridfleet.ps.worker.frontend import quick_interpreter_exit; before = atexit._ncallbacks(); "
            "quick_interpreter_exit(); quick_interpreter_exit(); print(atexit._ncallbacks() - before)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True"]  # the hook registered once; the objects alive at exit were frozen
