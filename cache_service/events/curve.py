"""CURVE on the KV event sockets: encryption, and with a clients folder, who may connect.

Keys are zmq.auth's certificate files (``zmq.auth.create_certificates(folder, name)``
writes ``name.key``, the public key, and ``name.key_secret``): the service loads its
secret key file; a subscriber (vllm-router, a script) is configured with the service's
public key and its own key pair. With a clients folder, zmq.auth's authenticator admits only the
public keys found there; without one, any client that knows the service's public key.
"""

from __future__ import annotations

import os

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from cache_service.events.settings import EventSettings


class CurveServer:
    """The authenticator of one context and the key its sockets serve with."""

    def __init__(self, context: zmq.Context, settings: EventSettings) -> None:
        path = settings.curve_secret_key
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as error:
            raise ValueError(f"--kv-events-curve-secret-key {path}: cannot load a CURVE key file: {error}") from None
        if not secret:
            raise ValueError(f"--kv-events-curve-secret-key {path} holds no secret key (is it the .key file "
                             "instead of .key_secret?)")
        clients = settings.curve_clients
        if clients is not None and not os.path.isdir(clients):
            raise ValueError(f"--kv-events-curve-clients {clients} is not a folder of public key files")
        self.public_key, self._secret = public, secret
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=clients if clients is not None else zmq.auth.CURVE_ALLOW_ANY)

    def serve(self, socket: zmq.Socket) -> None:
        """Makes ``socket`` (before it binds) a CURVE server."""
        socket.curve_secretkey = self._secret
        socket.curve_publickey = self.public_key
        socket.curve_server = True

    def close(self) -> None:
        self._auth.stop()
