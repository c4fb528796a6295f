"""The warm pool's messages (:mod:`.warmpool`, :mod:`.survivor`): JSON records, each after its length, over a
Unix socket in Linux's abstract namespace; a record may carry file descriptors."""
import json
import os
import socket
import struct

CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED's pid, uid, gid


def send(sock, record, fds=()):
    data = json.dumps(record).encode()
    message = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [message], list(fds)) if fds else sock.send(message)
    if sent < len(message):
        sock.sendall(message[sent:])


def receive(sock, max_fds=0):
    """One record (and the file descriptors sent with it), or ``(None, [])`` at the end of the connection."""
    data, fds = b"", []
    while len(data) < 4 or len(data) < 4 + struct.unpack("!I", data[:4])[0]:
        if max_fds and not fds:
            chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, max_fds)
        else:
            chunk = sock.recv(1 << 16)
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None, []
        data += chunk
    return json.loads(data[4:].decode()), fds


def address(name):
    return "\0" + name  # Linux's abstract namespace: no file to clean up; who may connect is checked (SO_PEERCRED)


def connect(name, record, timeout, fds=()):
    """A connection to ``name`` (a pool, or a rank's own socket) that sent ``record`` (and ``fds``), or None."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(address(name))
        send(sock, record, fds)
    except OSError:
        sock.close()
        return None
    return sock


def peer(conn):
    """``(pid, uid, gid)`` of the process at the other end of ``conn``: who may ask is checked by its uid."""
    return CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CREDENTIALS.size))
