"""What both examples share: a secret file and node configurations on loopback."""

import os
import tempfile


def secret_file() -> str:
    """A fresh shared secret, readable by its owner only (ferry refuses anything looser)."""
    path = os.path.join(tempfile.mkdtemp(prefix="ferry-example-"), "secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, os.urandom(32).hex().encode())
    os.close(fd)
    return path


def config(name: str, secret: str, peer=None, receive_into: str = "host") -> str:
    """A node on an ephemeral loopback port; `peer` is (name, address) or None."""
    text = (
        f'[node]\nname = "{name}"\nlisten = ["127.0.0.1:0"]\n'
        f'[security]\nsecret_file = "{secret}"\n'
        f'[memory]\nreceive_into = "{receive_into}"\n'
    )
    if peer:
        text += f'[[peers]]\nname = "{peer[0]}"\naddress = "{peer[1]}"\n'
    return text
