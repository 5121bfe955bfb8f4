"""A stand-in engine process: its own memfd KV buffer, registered by lending its fd on the engine socket.

    python -m tests.api.engine_proc URL NAMESPACE set|get|hold PAGE KEY...
Prints one JSON line: {"result": [...], "ok": bool}.
"""

import hashlib
import sys
import time

import orjson

from api.engine.client import SidecarClient
from api.engine.shm import SharedBuffer, page_first_chunks


def main(url: str, ns: str, op: str, page: int, keys: list[str]) -> None:
    client = SidecarClient(url)
    buf = SharedBuffer(page * max(len(keys), 1))
    bid = buf.register(client, ns, max(len(keys), 1), page_first_chunks(page))
    slots = list(range(len(keys)))
    if op == "set":
        for i, k in enumerate(keys):
            buf.view(i * page, page)[:] = hashlib.shake_256(k.encode()).digest(page)
        result = client.set(ns, keys, bid, slots)
        ok = all(result)
    elif op == "get":
        result = client.get(ns, keys, bid, slots)
        ok = all(result) and all(
            buf.view(i * page, page) == hashlib.shake_256(k.encode()).digest(page)
            for i, k in enumerate(keys)
        )
    else:  # hold: stay registered until killed
        print(orjson.dumps({"buffer_id": bid}).decode(), flush=True)
        time.sleep(600)
        return
    print(orjson.dumps({"result": result, "ok": ok}).decode(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
