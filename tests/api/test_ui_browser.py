"""/ui in a real headless browser (Debian's chromium) against a live sidecar with traffic:
every chart drew. Skipped where no browser is installed (`make test` installs one with apt).

Set UI_SCREENSHOT=docs/ui.png to keep the screenshot the test took."""

import os
import re
import shutil
import subprocess
import threading
import time

import pytest

from tests.api.test_ui import traffic

CHARTS = ("fill", "pages", "hit_rate", "gbps", "write_queue", "errors")
BROWSER = next(
    filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
)
# a longer run for the README's picture than for the check
WANT_SAMPLES = 40 if os.environ.get("UI_SCREENSHOT") else 3
pytestmark = pytest.mark.skipif(BROWSER is None, reason="no headless chromium installed")


TOKEN = "s3cret"


def login_url(srv) -> str:
    """The server's URL with the browser login (user `sidecar`, the token as password)."""
    return srv.url.replace("http://", f"http://sidecar:{TOKEN}@", 1)


def chromium(url: str, profile, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        BROWSER,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=6000",
        "--window-size=1200,460",
        *args,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def charts(dom: str) -> dict[str, int]:
    """data-chart -> data-points of each chart's svg in the dumped DOM."""
    out = {}
    for tag in re.findall(r"<svg\b[^>]*>", dom):
        name = re.search(r'data-chart="([^"]+)"', tag)
        points = re.search(r'data-points="(\d+)"', tag)
        if name and points:
            out[name.group(1)] = int(points.group(1))
    return out


@pytest.fixture
def busy_sidecar(make_server, tmp_path):
    """A sidecar with a file tier, a few seconds of samples of live traffic, traffic going on.
    A token: the browser logs in as the operator, who sees every tenant's namespaces (anonymous
    TCP would see only its own: the engines' namespaces here are their uid's)."""
    srv = make_server(file_tier=True, data_dir=str(tmp_path / "tier"), token=TOKEN)
    client = srv.client()
    client.put_namespace("kv", 4096, model="m")
    client.put_namespace("draft", 4096, model="m-draft", host_capacity_bytes=64 * 4096)
    stop = threading.Event()
    threads = [
        threading.Thread(target=traffic, args=(srv.client(), stop, ns)) for ns in ("kv", "draft")
    ]
    for t in threads:
        t.start()
    try:
        deadline = time.time() + 10 + 2 * WANT_SAMPLES
        while time.time() < deadline:
            samples = srv.tcp_client().request("GET", "/v1/samples")[1]["samples"]
            if sum(s["gbps_in"] > 0 for s in samples) >= WANT_SAMPLES:
                break
            time.sleep(0.2)
        yield srv
    finally:
        stop.set()
        for t in threads:
            t.join(10)


@pytest.mark.slow
def test_status_page_draws_every_chart(busy_sidecar, tmp_path):
    url = login_url(busy_sidecar) + "/ui"
    out = chromium(url, tmp_path / "profile-dom", "--dump-dom")
    assert out.returncode == 0, out.stderr[-2000:]
    drawn = charts(out.stdout)
    assert set(drawn) == set(CHARTS), drawn
    assert all(n >= 3 for n in drawn.values()), drawn  # several samples on every chart
    assert re.search(r'<div id="status"[^>]*>\d+ samples, one every', out.stdout)  # no error shown
    assert re.search(
        r'<div id="cost"[^>]*>[\d,]+ pages, [\d,]+ tokens cached\. Per page: host pool', out.stdout
    )
    fill = re.search(r'<svg\b[^>]*data-chart="fill"[^>]*>.*?</svg>', out.stdout, re.S).group(0)
    assert 'data-series="kv"' in fill and 'data-series="draft"' in fill  # one line per namespace
    shot = os.environ.get("UI_SCREENSHOT") or str(tmp_path / "ui.png")
    out = chromium(
        url, tmp_path / "profile-shot", f"--screenshot={os.path.abspath(shot)}", "--hide-scrollbars"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert_drawn(shot)


def assert_drawn(path: str) -> None:
    """The screenshot holds the charts' line colours, not just a blank page."""
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    image = pytest.importorskip("matplotlib.image")
    pixels = (image.imread(path)[..., :3] * 255).round().astype(int)
    blue = ((abs(pixels - [0x1F, 0x77, 0xB4]).sum(axis=-1)) < 30).sum()
    orange = ((abs(pixels - [0xFF, 0x7F, 0x0E]).sum(axis=-1)) < 30).sum()
    assert blue > 200 and orange > 50, (blue, orange)


def test_api_docs_render_offline(make_server, tmp_path):
    """Swagger UI, from the installed package, renders the sidecar's own OpenAPI document."""
    srv = make_server()
    out = chromium(srv.url + "/docs", tmp_path / "profile-docs", "--dump-dom")
    assert out.returncode == 0, out.stderr[-2000:]
    dom = out.stdout
    assert "Unable to render" not in dom and "Failed to load" not in dom, dom[-3000:]
    assert dom.count('class="opblock ') >= 10  # one block per operation
    assert "/v1/namespaces/{name}/exists" in dom


@pytest.mark.slow
def test_a_browser_logs_in_with_the_token(make_server, tmp_path):
    """With --token, a browser answers the Basic challenge (user `sidecar`, the token as
    password) and the page's own polling is authorized by the same login."""
    srv = make_server(token="s3cret")
    host = srv.url.removeprefix("http://")
    refused = chromium(srv.url + "/ui", tmp_path / "profile-anon", "--dump-dom")
    assert "data-chart" not in refused.stdout  # headless: no login dialog, the load fails
    out = chromium(f"http://sidecar:s3cret@{host}/ui", tmp_path / "profile-login", "--dump-dom")
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.search(r'<div id="status"[^>]*>\d+ samples, one every', out.stdout), out.stdout[
        -1500:
    ]
    assert set(charts(out.stdout)) == set(CHARTS)
    docs = chromium(f"http://sidecar:s3cret@{host}/docs", tmp_path / "profile-docs", "--dump-dom")
    assert docs.stdout.count('class="opblock ') >= 10


@pytest.mark.slow
def test_anonymous_browser_sees_no_other_tenants_fill(make_server, tmp_path):
    """Without a token a browser is anonymous TCP, a tenant of its own: the engine's
    namespace (its uid's) draws no line of fill and its name is nowhere on the page."""
    srv = make_server()
    srv.client().put_namespace("secret-customer", 4096, model="m", host_capacity_bytes=64 * 4096)
    srv.tcp_client().put_namespace("mine", 4096, model="m", host_capacity_bytes=64 * 4096)
    time.sleep(2.5)  # two samples of the 1 s sampler
    out = chromium(srv.url + "/ui", tmp_path / "profile-anon", "--dump-dom")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "secret-customer" not in out.stdout
    fill = re.search(r'<svg\b[^>]*data-chart="fill"[^>]*>.*?</svg>', out.stdout, re.S).group(0)
    assert 'data-series="mine"' in fill
