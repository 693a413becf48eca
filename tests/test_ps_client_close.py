"""PSClient.close() while its heartbeat thread is between two shards' beats: the thread ends quietly.

The first shard's stub is replaced by one whose Heartbeat runs close() (as the training thread
does when the job ends) — the race that left "Cannot invoke RPC on closed channel!" tracebacks
from the heartbeat thread at large worker counts. The second stub is the client's own, on a real
(closed) gRPC channel.
"""

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
