"""What a person opens in a browser: `/ui` (a live status page over `/v1/samples`) and
`/docs` (Swagger UI over `/openapi.json`). Every file is served from installed packages:
nothing is fetched from the internet. Behind the token like every route but /healthz."""

from __future__ import annotations

from importlib import resources
from importlib.util import find_spec
from pathlib import Path

from fastapi import APIRouter, Depends
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, Response

from api.deps import context, observer
from api.wire import json, number
from sidecar import report
from sidecar.context import Context
from sidecar.errors import NotFound
from sidecar.samples import INTERVAL


def package_dir(name: str) -> Path:
    """The directory of the installed package `name`, found without importing it."""
    spec = find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed (a dependency of kv-sidecar)")
    return Path(spec.submodule_search_locations[0])


router = APIRouter(include_in_schema=False)
STATIC = resources.files("api") / "static"
# Swagger UI 5 (it reads OpenAPI 3.1) as the fastapi-offline package ships it; only its
# files are used, found without importing it. /docs serves these names and nothing else.
SWAGGER_DIR = package_dir("fastapi_offline") / "static"
SWAGGER_FILES = {
    "swagger-ui.css": "text/css",
    "swagger-ui-bundle.js": "text/javascript",
    "favicon.png": "image/png",
}
DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kv-sidecar API</title>
<link rel="stylesheet" href="/docs/swagger-ui.css">
<link rel="icon" type="image/png" href="/docs/favicon.png"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>window.ui = SwaggerUIBundle({url: location.origin + "/openapi.json", dom_id: "#swagger-ui",
  deepLinking: true, validatorUrl: null});</script>
</body></html>"""


@router.get("/ui")
async def status_page() -> Response:
    return HTMLResponse((STATIC / "ui.html").read_text(encoding="utf-8"))


@router.get("/v1/samples")
async def samples(request: Request, ctx: Context = Depends(context)) -> Response:
    since = number(request, "since", "0", "unix seconds")
    samples = report.fill_for(ctx.store, observer(ctx, request.scope), ctx.sampler.since(since))
    return json({"interval_s": INTERVAL, "samples": samples})


@router.get("/docs")
async def docs() -> Response:
    return HTMLResponse(DOCS_PAGE)


@router.get("/docs/{name}")
async def docs_file(name: str) -> Response:
    media = SWAGGER_FILES.get(name)
    if media is None:
        raise NotFound(f"no file {name[:64]!r} under /docs")
    return FileResponse(
        SWAGGER_DIR / name, media_type=media, headers={"cache-control": "max-age=86400"}
    )
