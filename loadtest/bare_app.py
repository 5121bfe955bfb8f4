"""The limit for `exists`: a bare FastAPI endpoint that takes the same JSON body and parses it."""
import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response


def create_bare_app() -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    @app.post("/v1/namespaces/{name}/exists")
    async def exists(name: str, request: Request) -> Response:
        body = orjson.loads(await request.body())
        return Response(orjson.dumps({"prefix": len(body["keys"]) * 0}), media_type="application/json")

    @app.get("/readyz")
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    return app
