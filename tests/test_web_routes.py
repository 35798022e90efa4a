"""The web page's routes, in the app itself (no engine started): the page and every asset it names are
served from the package, open without the API key while /v1 stays protected; the JSON endpoints answer
bad input with OpenAI's error JSON; --no-web removes the page; the assets ship in the wheel and never
turn text into markup."""
from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvserve.entrypoints.cli import build_parser
from kvserve.entrypoints.openai.api_server import ServerArgs, build_app
from kvserve.entrypoints.web.routes import STATIC_DIR

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "route-test-key"


@pytest.fixture(scope="module")
def client() -> TestClient:
    # Not entered as a context manager: the lifespan (and so the engine) never starts.
    return TestClient(build_app(ServerArgs(api_keys=[API_KEY])))


def asset_paths(html: str) -> list[str]:
    return ["/" + path for path in re.findall(r'(?:src|href)="(static/[^"]+)"', html)]


def test_page_and_its_assets_are_served_without_the_key(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "object-src 'none'" in csp and "unsafe-inline" not in csp
    assets = asset_paths(page.text)
    assert "/static/js/main.js" in assets and "/static/style.css" in assets and "/static/favicon.svg" in assets
    types = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
    for path in assets:
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.headers["content-type"].startswith(types[Path(path).suffix]), (path, r.headers["content-type"])
        # Revalidated, as the page is: a browser had reused them by heuristic after an upgrade.
        assert r.headers["cache-control"] == "no-cache", path
        again = client.get(path, headers={"If-None-Match": r.headers["etag"]})
        assert again.status_code == 304 and not again.content, path
    favicon = client.get("/favicon.ico")
    assert favicon.status_code == 200 and favicon.headers["content-type"].startswith("image/svg+xml")
    # The API itself still wants the key.
    assert client.get("/v1/models").status_code == 401


def test_the_page_names_its_server_by_relative_urls_only():
    """Behind a reverse proxy that serves it under a path (https://host/kv/), a URL from the root ("/static/..",
    "/v1/..") left that path: every asset was a 404 and the page stayed blank."""
    rooted = re.compile(r"""(?:(?:src|href)=|fetch\(|request\(|json\(|import\()\s*["'`]/(?!/)""")
    for path in [STATIC_DIR / "index.html", *sorted((STATIC_DIR / "js").glob("*.js"))]:
        found = rooted.findall(path.read_text())
        assert not found, (path.name, found)


def test_every_module_import_resolves():
    for js in (STATIC_DIR / "js").glob("*.js"):
        for target in re.findall(r"from '(\./[^']+)'", js.read_text()):
            assert (js.parent / target).is_file(), f"{js.name} imports missing {target}"


def test_no_asset_turns_text_into_markup_or_loads_from_elsewhere():
    # The renderer's safety argument is that text only ever becomes text nodes; keep it true everywhere.
    forbidden = re.compile(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|"
                           r"setAttribute\('on|javascript:")
    for path in STATIC_DIR.rglob("*"):
        if path.suffix in (".js", ".html", ".css"):
            text = path.read_text()
            assert not forbidden.search(text), f"{path.name}: {forbidden.search(text).group(0)}"
            # No CDN, no fonts from elsewhere: every URL the page loads is its own (links to docs are text).
            assert not re.search(r"(?:src|href)=\"https?:|url\(\s*['\"]?https?:|from 'https?:", text), path.name


def test_dashboard_and_info_are_open_and_validate_their_input(client):
    info = client.get("/api/info").json()
    assert info["api_key_required"] is True and info["web_page"] is True
    d = client.get("/api/dashboard")
    assert d.status_code == 200
    body = d.json()
    assert body["object"] == "dashboard" and "kvserve:generation_tokens_total" in body["totals"]
    assert client.get("/api/dashboard?window=60").json()["window_s"] == 60
    for bad in ("5", "abc", "1e9", "nan", "-1"):
        r = client.get(f"/api/dashboard?window={bad}")
        assert r.status_code == 400, bad
        assert r.json()["error"]["param"] == "window" and r.json()["error"]["type"] == "BadRequestError"


def test_no_web_removes_the_page_but_keeps_the_api():
    client = TestClient(build_app(ServerArgs(web=False)))
    for path in ("/", "/static/js/main.js", "/favicon.ico"):
        r = client.get(path)
        assert r.status_code == 404 and "error" in r.json(), path
    assert client.get("/api/dashboard").status_code == 200
    assert client.get("/api/info").json() == {**client.get("/api/info").json(), "web_page": False,
                                              "api_key_required": False}


def test_no_web_flag():
    assert build_parser().parse_args(["serve", "--no-web"]).web is False
    assert build_parser().parse_args(["serve"]).web is True


def test_every_asset_is_package_data():
    """What pyproject's package-data globs match is what lands in the wheel (checked by building one once;
    this keeps a new asset from being left out)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["kvserve.entrypoints.web"]
    package_dir = STATIC_DIR.parent
    for path in STATIC_DIR.rglob("*"):
        if path.is_file():
            rel = path.relative_to(package_dir).as_posix()
            assert any(fnmatch.fnmatch(rel, p) and rel.count("/") == p.count("/") for p in patterns), rel
