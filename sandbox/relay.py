"""The one road out of a whole-harness sandbox: a TCP relay from inside its network namespace to the gateway.

The listening socket was made inside the sandbox's network namespace (`sandbox.namespaces`), where
it is the only thing on 127.0.0.1; the connections it accepts are relayed by threads of this (host)
process, whose sockets live in the host's namespace, to the gateway's host:port and nowhere else.
No unix socket is mounted into the sandbox and nothing extra runs inside it.
"""

from __future__ import annotations

import logging
import socket
import threading

log = logging.getLogger(__name__)

CHUNK = 64 << 10


class Relay:
    def __init__(self, listener: socket.socket, target: tuple[str, int]):
        self.listener = listener
        self.target = target
        self.connections = 0
        self._thread = threading.Thread(target=self._accept, name=f"sandbox-relay-{target[1]}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                inside, _ = self.listener.accept()
            except OSError:
                return  # the listener was shut down: the sandbox closed
            self.connections += 1
            threading.Thread(target=self._connect, args=(inside,), daemon=True).start()

    def _connect(self, inside: socket.socket) -> None:
        try:
            outside = socket.create_connection(self.target, timeout=10)
        except OSError as exc:
            log.warning("sandbox relay: cannot reach the gateway at %s:%s: %s", *self.target, exc)
            inside.close()
            return
        outside.settimeout(None)
        back = threading.Thread(target=_pump, args=(outside, inside), daemon=True)
        back.start()
        _pump(inside, outside)
        back.join()
        inside.close()
        outside.close()

    def close(self) -> None:
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self.listener.close()
        self._thread.join(timeout=5)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy until end of stream, then pass the half-close on (an error ends both directions)."""
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
