"""The ZAP authenticator's thread ends quietly when its owner terminates the context first.

An operator's trial: an agent whose ``--prefill-bind`` could not be bound exited 1 with its error, then printed
``Exception in thread zap-authenticator: ... zmq.error.ContextTerminated``.
"""

from __future__ import annotations

import threading

import zmq

from agents.wan.zap import ZapAuthenticator


def test_an_authenticator_whose_context_is_terminated_ends_without_a_traceback(monkeypatch) -> None:
    failures: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failures.append(args.exc_type.__name__))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    zap = ZapAuthenticator(ctx, None).start()
    ctx.term()  # its owner gave up (a socket it could not bind) without stopping it
    zap._thread.join(5.0)
    assert not zap._thread.is_alive() and failures == []
