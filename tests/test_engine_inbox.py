"""The engine's inbox: typed messages, taken one at a time, so a handler that raises
(a failed session) leaves the messages behind it for whoever drains next."""

from __future__ import annotations

from model_service.engine.inbox import Abort, Cancel, Inbox, SessionFailed, Wake


def test_messages_come_out_in_order_and_the_inbox_is_then_empty():
    inbox = Inbox()
    for message in (Cancel(1), Abort((2, 3)), Wake()):
        inbox.put(message)
    assert list(inbox.drain(block=False)) == [Cancel(1), Abort((2, 3)), Wake()]
    assert list(inbox.drain(block=True, timeout_s=0.01)) == []


def test_a_handler_that_raises_leaves_the_rest_queued():
    inbox = Inbox()
    failure = SessionFailed("s1", RuntimeError("heartbeat failed"))
    for message in (Cancel(1), failure, Cancel(2), Cancel(3)):
        inbox.put(message)
    handled = []
    try:
        for message in inbox.drain(block=False):
            handled.append(message)
            if isinstance(message, SessionFailed):
                raise RuntimeError("the engine loses its session here")
    except RuntimeError:
        pass
    assert handled == [Cancel(1), failure]
    assert list(inbox.drain(block=False)) == [Cancel(2), Cancel(3)]
