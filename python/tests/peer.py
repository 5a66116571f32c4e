"""A ferry node in a process of its own, for the tests: ``python peer.py CONFIG PARENT``.

It starts a node from the configuration file CONFIG, greets PARENT (a peer of that file)
with a buffer under ``HELLO`` so that PARENT can send to it over the link this opens, prints
``ready`` on stdout, then sends every buffer it receives back to its sender under the same
tag (the received buffer itself: no copy), until it receives one under ``STOP``.

A buffer under ``FETCH`` names a key instead: the peer fetches that key from the sender and
sends what it got back under ``FETCH`` (or ``error: <reason>`` when the fetch failed).
"""

import sys

import ferry

HELLO = 2**63 - 1
STOP = 2**63 - 2
FETCH = 2**63 - 3


def main() -> None:
    config, parent = sys.argv[1], sys.argv[2]
    with ferry.Node(config_file=config) as node:
        node.send(parent, HELLO, b"hello")
        print("ready", flush=True)
        while True:
            got = node.recv()
            if got.tag == STOP:
                break
            if got.tag == FETCH:
                key = got.tobytes().decode()
                try:
                    fetched = node.fetch(got.peer, key, timeout=10.0)
                except ferry.FerryError as e:
                    fetched = f"error: {getattr(e, 'reason', e.kind)}".encode()
                node.send(got.peer, FETCH, fetched)
                continue
            node.send(got.peer, got.tag, got)


if __name__ == "__main__":
    main()
