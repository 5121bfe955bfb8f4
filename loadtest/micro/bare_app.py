"""The limit for the hot routes: a bare FastAPI endpoint per route that takes the same JSON
body, parses it, and answers the same shape without doing the work. Served like the
sidecar: uvicorn, uvloop, httptools, on loopback TCP and on a Unix socket.

    python -c "from loadtest.micro.bare_app import serve; serve(PORT, '/path/s.sock')"
"""

import socket

import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response


def create_bare_app() -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/namespaces/{name}/exists")
    async def exists(name: str, request: Request) -> Response:
        body = orjson.loads(await request.body())
        return Response(
            orjson.dumps({"prefix": len(body["keys"]) * 0}), media_type="application/json"
        )

    @app.post("/v1/namespaces/{name}/set")
    async def set_pages(name: str, request: Request) -> Response:
        body = orjson.loads(await request.body())
        return Response(
            orjson.dumps({"stored": [True] * len(body["keys"])}), media_type="application/json"
        )

    @app.post("/v1/namespaces/{name}/get")
    async def get_pages(name: str, request: Request) -> Response:
        body = orjson.loads(await request.body())
        return Response(
            orjson.dumps({"loaded": [True] * len(body["keys"])}), media_type="application/json"
        )

    @app.get("/readyz")
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    return app


def serve(port: int, uds: str) -> None:
    import uvicorn

    tcp = socket.create_server(("127.0.0.1", port), backlog=2048)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(uds)
    unix.listen(2048)
    config = uvicorn.Config(
        create_bare_app(), loop="uvloop", http="httptools", log_level="warning", access_log=False
    )
    uvicorn.Server(config).run(sockets=[tcp, unix])
