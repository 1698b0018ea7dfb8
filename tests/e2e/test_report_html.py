"""`ffctl report RUN --html` of a real run with two faults, opened in headless Chromium.

A tiny job survives a kill-rank and a kill-node; its report page is rendered by Debian's
`chromium` (installed by scripts/setup) from a file URL, offline. Chromium's DOM after load
says whether each embedded image decoded (a probe script, added to a copy of the page, marks
every `img` by its naturalWidth), and its screenshot must not be blank: its pixels are decoded
and must vary, with a fair share of them not background.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.launch import assert_nothing_left, launch, rid, run_ffctl, shm_left

# A job with two faults run, then its page rendered by a headless Chromium.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_TIMEOUT = 120.0
PROBE = """<script>
window.addEventListener("load", () => {
  const imgs = Array.from(document.images);
  const ok = imgs.filter((img) => img.complete && img.naturalWidth > 0 && img.naturalHeight > 0);
  imgs.forEach((img) => img.setAttribute("data-decoded", String(img.naturalWidth > 0)));
  document.body.setAttribute("data-images", String(imgs.length));
  document.body.setAttribute("data-decoded", String(ok.length));
});
</script>"""


def chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    # --no-sandbox: Chromium refuses to start as root with its sandbox; the page is our own file.
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-background-networking", "--disable-extensions", "--hide-scrollbars",
                           f"--user-data-dir={profile}", *args],
                          capture_output=True, text=True, timeout=BROWSER_TIMEOUT)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup installs Debian's chromium)")
def test_the_html_report_of_a_run_with_two_faults_renders_in_headless_chromium(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image", reason="the html extra (matplotlib) is not installed")
    run_id = rid("html")
    res = launch(tmp_path, run_id, "--nnodes", "2", "--nproc-per-node", "1", "--steps", "30", "--model", "tiny",
                 "--inject", "kill-rank:rank=1,step=10", "--inject", "kill-node:node=1,step=20")
    assert res.returncode == 0, res.stderr[-3000:]
    assert [f["kind"] for f in res.report["faults"]] == ["kill-rank", "kill-node"]
    assert all(f["recovered"] for f in res.report["faults"])
    page = tmp_path / "report.html"
    proc = run_ffctl(tmp_path, "report", run_id, "--html", str(page))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = page.read_text()
    assert len(re.findall(r'<img src="data:image/png;base64,', text)) == 2

    probe = tmp_path / "probe.html"
    probe.write_text(text.replace("</body>", PROBE + "</body>"))
    dom = chromium(tmp_path / "profile", "--dump-dom", probe.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body[^>]*>", dom.stdout)
    assert body is not None, dom.stdout[:2000]
    assert 'data-images="2"' in body.group(0) and 'data-decoded="2"' in body.group(0), body.group(0)
    assert "f1" in dom.stdout and "kill-node" in dom.stdout

    shot = tmp_path / "report.png"
    got = chromium(tmp_path / "profile", f"--screenshot={shot}", "--window-size=1280,1600", page.as_uri())
    assert got.returncode == 0 and shot.exists(), got.stderr[-2000:]
    pixels = image.imread(str(shot))[..., :3]  # floats in [0, 1], height x width x RGB
    assert pixels.shape[:2] == (1600, 1280)
    grey = pixels.mean(axis=2)
    assert grey.std() > 0.08, grey.std()  # a blank page has none
    assert (grey < 0.9).mean() > 0.03  # text, lines and shaded phases, not a white sheet
    # The shaded recovery phases are in colour: some pixels are far from grey.
    assert (pixels.max(axis=2) - pixels.min(axis=2) > 0.15).mean() > 0.001

    assert_nothing_left(tmp_path)
    assert shm_left(run_id) == []
