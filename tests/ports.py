"""Free TCP ports for the servers tests start (Ray heads, MLflow servers, addresses nobody answers on)."""

import random
import socket

# Below the kernel's ephemeral range (32768-60999 here) and above Ray's worker ports (10002-19999): a port drawn
# from the ephemeral range can be taken, between the draw and the server's start, by any of the many processes
# (Ray's among them) that bind port 0 meanwhile, and a client then reaches the wrong server.
LOW, HIGH = 20000, 32767


def free_port() -> int:
    """A port nobody listens on now, drawn at random from LOW..HIGH so that parallel tests rarely draw the same."""
    draw = random.SystemRandom()
    while True:
        port = draw.randint(LOW, HIGH)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
