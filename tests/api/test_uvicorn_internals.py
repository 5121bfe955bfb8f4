"""sidecar/server.py subclasses uvicorn's private httptools protocol, request cycle and flow
control (issue 56): uvicorn is pinned in constraints.txt, and this test fails loudly when
the installed uvicorn is another one or lacks what the subclasses use. On a bump: read
uvicorn's httptools_impl.py and flow_control.py diff against the names below, then move
the pin here and in constraints.txt together."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import uvicorn
from uvicorn.protocols.http import flow_control, httptools_impl

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = (  # methods sidecar/server.py overrides or calls through super()
    "connection_made",
    "connection_lost",
    "data_received",
    "on_message_begin",
    "on_header",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "pause_writing",
    "resume_writing",
    "_unset_keepalive_if_required",
)
STATE = ("transport", "flow", "cycle", "parser", "pipeline", "headers", "scope", "loop")


def pinned() -> str:
    text = (ROOT / "constraints.txt").read_text()
    m = re.search(r"^uvicorn==([\w.]+)", text, re.M)
    assert m, "constraints.txt pins uvicorn"
    return m.group(1)


def test_the_installed_uvicorn_is_the_pinned_one():
    assert uvicorn.__version__ == pinned(), (
        f"uvicorn {uvicorn.__version__} is not the pinned {pinned()}: sidecar/server.py "
        "subclasses its private protocol; check the names in this test against it"
    )


def test_the_private_names_the_server_builds_on_are_there():
    proto = httptools_impl.HttpToolsProtocol
    missing = [m for m in PROTOCOL if not callable(getattr(proto, m, None))]
    assert not missing, f"uvicorn's HttpToolsProtocol lacks {missing}"
    init = inspect.getsource(proto.__init__) + inspect.getsource(proto.connection_made)
    init += inspect.getsource(proto.on_message_begin) + inspect.getsource(proto.on_url)
    absent = [a for a in STATE if f"self.{a}" not in init]
    assert not absent, f"uvicorn's protocol no longer sets {absent}"
    assert callable(httptools_impl.RequestResponseCycle.receive)
    assert isinstance(httptools_impl.STATUS_LINE, dict) and 200 in httptools_impl.STATUS_LINE
    assert isinstance(flow_control.HIGH_WATER_LIMIT, int)
    for m in ("pause_reading", "resume_reading", "pause_writing", "resume_writing"):
        assert callable(getattr(flow_control.FlowControl, m, None)), m
