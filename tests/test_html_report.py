"""`fabric-run --html`: one self-contained page, checked as text and in a real browser
(headless Chromium, which .ci/run installs; the browser test skips with a reason elsewhere)."""
import re
import shutil
import subprocess

import pytest

from conftest import POLICIES
from test_runtime import compile_text, fabric_run

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The reference policy, with a hostile comment in its source, run with a baseline, its
    chains and a trace."""
    tmp = tmp_path_factory.mktemp("html")
    text = (POLICIES / "prefill_qos.fx").read_text().replace(
        "policy prefill_qos {", "// <script>alert('x')</script> & <b>not bold</b>\npolicy prefill_qos {")
    out = compile_text(tmp, text, "hostile")
    html, trace = tmp / "site" / "report.html", tmp / "run.trace.json"
    r = fabric_run("--policy", out, "--prompt", "512", "--tp", "2", "--baseline", "--explain",
                   "--trace", trace, "--html", html, "-q")
    assert r.returncode == 0, r.stderr
    return html, text


def test_the_page_holds_everything_and_fetches_nothing(page):
    html, source = page
    text = html.read_text()
    for table in ("movements", "links", "islands", "map-kv_bytes"):
        assert f'<table id="{table}">' in text
    assert len(re.findall(r'<img src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', text)) == 2
    assert not re.search(r'(src|href)="(https?:)?//', text)            # nothing from the network
    assert '<a href="../run.trace.json">' in text                    # the trace, from the page's folder
    assert "Why the GPUs waited" in text and "Against the baseline" in text


def test_the_policy_is_shown_escaped_with_the_lines_that_decided(page):
    html, source = page
    text = html.read_text()
    assert "<script>alert" not in text and "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in text
    line = next(n for n, s in enumerate(source.splitlines(), 1) if "on attn_weights.forward" in s)
    marked = re.search(rf'<span class="decided"><span class="lineno">{line}</span>(.*?)</span></span>', text)
    assert marked and "sw0.forward (attn_weights): priority; the hook decided 7 x" in marked.group(1)


@pytest.mark.skipif(CHROMIUM is None, reason="no headless browser here: apt-get install chromium")
def test_a_browser_loads_it_offline_without_errors(page, tmp_path):
    html, _ = page
    browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    dom = subprocess.run(browser + ["--enable-logging=stderr", "--v=0", "--dump-dom", html.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "CONSOLE" not in dom.stderr, [x for x in dom.stderr.splitlines() if "CONSOLE" in x]
    assert 'data-images="2"' in dom.stdout          # the page's own check: both plots decoded
    assert dom.stdout.count("<table") >= 4 and "<tbody>" in dom.stdout
    shot = tmp_path / "report.png"
    r = subprocess.run(browser + [f"--screenshot={shot}", "--window-size=1300,3000", html.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and shot.stat().st_size > 20_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_manifest_naming_a_device_as_its_source_does_not_hang_the_page(tmp_path):
    """The manifest is untrusted: a source path that is a device (or any huge file) is not read."""
    from fabric_ext.runtime.simulation import html_report
    data = {"policy": "p", "workload": {"model": "m", "prompt": 1, "batch": 1, "tp": 1, "weights": "hbm", "kv": "hbm",
                                        "kv_export": None},
            "ttft_ms": 1.0, "backend": "interp", "events": 1, "movements": [], "links": [], "islands": [],
            "layers": [], "kv_done_ms": 0.0}
    manifest = {"programs": [], "sources": [{"file": "p.fx", "path": "/dev/zero", "sha256": "0" * 64}]}
    page, _ = html_report.render(data, manifest)
    assert "/dev/zero is not there any more (or is not a policy source)" in page


def test_without_matplotlib_the_page_says_so_and_the_run_warns(tmp_path, monkeypatch):
    from fabric_ext import api
    from fabric_ext.runtime.simulation import stats
    from policy_helpers import compiled

    def no_matplotlib(*_):
        raise ImportError("matplotlib")
    monkeypatch.setattr(stats, "plots", no_matplotlib)
    page, warnings = api.run(compiled("nic_pacing"), prompt=256, backend="interp").html()
    assert warnings == ["no plots: they need matplotlib (pip install 'fabric-ext[plot]')"]
    assert "no plots: they need matplotlib" in page and "<img" not in page


def test_html_takes_one_policy(tmp_path):
    r = fabric_run("--policy", POLICIES / "nic_pacing.fx", "--policy", POLICIES / "kv_tiering.fx",
                   "--html", tmp_path / "r.html")
    assert r.returncode == 2 and "--html take one policy" in r.stderr and not (tmp_path / "r.html").exists()
