"""``luopan report`` in a real browser (headless Chromium through Selenium): no console errors, each chart holds the
expected points and bars for the known repository (tests/test_report.py), hover titles name the checkpoint, the page
fits a 1280-pixel window, dark mode renders, and the served page reloads itself when a run saves. Screenshots are
kept under the test's tmp dir and, when LUOPAN_ARTIFACTS is set, there.

Skips (saying why) only when chromium, chromedriver or selenium is missing: `make system-deps` installs the first
two (CI does), the `dev` extra the third."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

import luopan
from luopan.report import ReportServer, write_report

from .test_report import MANIFESTS, PRUNED, RUN_A_STEPS, RUN_B_STEPS, make_repo

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
    HAVE_SELENIUM = True
except ImportError:
    HAVE_SELENIUM = False

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER and HAVE_SELENIUM),
    reason="needs chromium and chromedriver (make system-deps: apt-get install chromium chromium-driver) and the "
           "selenium package (pip install -e '.[dev]')")

WIDTH = 1280


def new_driver(height: int = 900):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={WIDTH},{height}", "--hide-scrollbars=false", "--force-device-scale-factor=1"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(60)
    return driver


def keep(driver, name: str, tmp_path) -> str:
    """A screenshot as a test artifact: under the test's tmp dir, and in $LUOPAN_ARTIFACTS when set."""
    path = str(tmp_path / name)
    assert driver.save_screenshot(path)
    dest = os.environ.get("LUOPAN_ARTIFACTS")
    if dest:
        os.makedirs(dest, exist_ok=True)
        shutil.copy(path, os.path.join(dest, name))
    return path


def errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    base = tmp_path_factory.mktemp("report-browser")
    path = make_repo(base / "repo")
    out = base / "report.html"
    r = luopan.open(path, create=False)
    try:
        write_report(r, out)
    finally:
        r.close()
    return path, out


@pytest.fixture(scope="module")
def driver():
    d = new_driver()
    yield d
    d.quit()


def count(driver, css: str) -> int:
    return driver.execute_script("return document.querySelectorAll(arguments[0]).length", css)


def test_page_renders_without_errors_and_charts_hold_the_known_repository(report, driver, tmp_path):
    _repo, out = report
    driver.get(out.as_uri())
    assert driver.execute_script("return document.readyState") == "complete"
    assert errors(driver) == []
    loss_a = 'svg[data-chart="metric-loss"][data-run="run-a"]'
    assert count(driver, f"{loss_a} circle.pt") == len(RUN_A_STEPS) + 1  # + the pruned step from its eval log
    assert count(driver, f"{loss_a} circle.pt.pruned") == 1
    assert count(driver, f'{loss_a} circle.pt[data-step="{PRUNED}"].pruned') == 1
    assert count(driver, 'svg[data-chart="metric-acc"][data-run="run-a"] circle.pt') == 2
    assert count(driver, 'svg[data-chart="metric-loss"][data-run="run-b"] circle.pt') == len(RUN_B_STEPS)
    assert count(driver, f"{loss_a} g.tick") == len(RUN_A_STEPS) + 1  # every checkpoint marked on the axis
    assert count(driver, f"{loss_a} circle.pt.pinned") == 1 and count(driver, f"{loss_a} circle.pt.latest") == 1
    for run, steps in (("run-a", RUN_A_STEPS), ("run-b", RUN_B_STEPS)):
        assert count(driver, f'svg[data-chart="storage"][data-run="{run}"] rect.bar[data-part="written"]') == \
            len(steps)
        tiers = f'svg[data-chart="tiers"][data-run="{run}"] rect.cell'
        assert count(driver, tiers) == len(steps) + (1 if run == "run-a" else 0)
    assert count(driver, 'svg[data-chart="storage"][data-run="run-a"] rect.bar[data-part="delta"]') >= 1
    assert count(driver, 'svg[data-chart="cumulative"] circle.pt.s-written') == MANIFESTS
    assert count(driver, 'svg[data-chart="cumulative"] circle.pt.s-full') == MANIFESTS
    assert count(driver, 'svg[data-chart="dedup"] rect.bar[data-series="run-b"][data-from="run-a"]') == 1
    assert count(driver, 'svg[data-chart="lineage"] g.node') == 3
    assert count(driver, 'svg[data-chart="lineage"] path.edge') == 2
    # every point and bar carries hover text naming what it stands for
    missing = driver.execute_script(
        "return [...document.querySelectorAll('circle.pt, rect.bar, rect.cell')]"
        ".filter(e => !e.querySelector('title') || !e.querySelector('title').textContent).length")
    assert missing == 0
    hover = driver.execute_script(
        f"return document.querySelector('{loss_a} circle.pt[data-step=\"300\"] title').textContent")
    assert hover.startswith("run-a step 300") and "pinned (release-1)" in hover
    bar = driver.execute_script("return document.querySelector('svg[data-chart=\"storage\"][data-run=\"run-b\"] "
                                "rect.bar[data-step=\"50\"] title').textContent")
    assert bar.startswith("run-b step 50")
    # fits a 1280-pixel window: no horizontal scrollbar; charts drawn at a readable size
    assert driver.execute_script("return window.innerWidth") == WIDTH
    assert driver.execute_script("return document.documentElement.scrollWidth") <= WIDTH
    width = driver.execute_script(f"return document.querySelector('{loss_a}').getBoundingClientRect().width")
    assert 500 <= width <= WIDTH / 2  # metric charts two to a row
    storage = 'svg[data-chart="storage"][data-run="run-a"]'
    width = driver.execute_script(f"return document.querySelector('{storage}').getBoundingClientRect().width")
    assert 1000 <= width <= WIDTH
    keep(driver, "report-light.png", tmp_path)


def test_tables_are_the_text_alternative(report, driver):
    _repo, out = report
    driver.get(out.as_uri())
    charts = count(driver, "svg.chart")
    alts = driver.execute_script(
        "return [...document.querySelectorAll('svg.chart')].filter(s => "
        "s.closest('figure') && s.closest('figure').querySelector('details.alt table')).length")
    assert alts == charts
    rows = driver.execute_script(
        "const f = document.querySelector('svg[data-chart=\"metric-loss\"][data-run=\"run-a\"]').closest('figure');"
        "f.querySelector('details').open = true; return [...f.querySelectorAll('tbody tr')]"
        ".map(r => r.firstElementChild.textContent)")
    assert rows == ["100", "200", "300", "400"]


def test_dark_mode(report, driver, tmp_path):
    _repo, out = report
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia",
                           {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    try:
        driver.get(out.as_uri())
        assert driver.execute_script("return matchMedia('(prefers-color-scheme: dark)').matches")
        bg = driver.execute_script("return getComputedStyle(document.body).backgroundColor")
        fg = driver.execute_script("return getComputedStyle(document.body).color")
        assert bg == "rgb(16, 19, 24)" and fg == "rgb(228, 231, 238)"
        line = driver.execute_script("return getComputedStyle(document.querySelector('path.line.s-metric')).stroke")
        assert line == "rgb(96, 165, 250)"
        assert errors(driver) == []
        keep(driver, "report-dark.png", tmp_path)
    finally:
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
    driver.get(out.as_uri())
    assert driver.execute_script("return getComputedStyle(document.body).backgroundColor") == "rgb(255, 255, 255)"


def test_served_page_reloads_when_a_run_saves(report, driver, tmp_path):
    repo_path, _out = report
    copy = tmp_path / "copy"
    shutil.copytree(repo_path, copy)
    with ReportServer(lambda: luopan.open(copy, create=False), port=0, poll_ms=200).start() as server:
        driver.get(server.url)
        driver.execute_script("window.__marker = 1")
        time.sleep(1.0)  # several polls: nothing changed, no reload
        assert driver.execute_script("return window.__marker") == 1
        repo = luopan.open(copy)
        try:
            repo.save("run-b", 60, {"bias": np.zeros(8, np.float32)}, metrics={"loss": 0.5})
        finally:
            repo.close()
        deadline = time.monotonic() + 20
        while driver.execute_script("return window.__marker === undefined && "
                                    "document.readyState === 'complete'") is not True:
            assert time.monotonic() < deadline, "the served page did not reload after a save"
            time.sleep(0.1)
        assert count(driver, 'svg[data-chart="metric-loss"][data-run="run-b"] circle.pt[data-step="60"]') == 1
        assert errors(driver) == []
        keep(driver, "report-served.png", tmp_path)


@pytest.fixture(scope="module")
def compare_report(tmp_path_factory):
    from .test_report_compare import make_compare_repo
    base = tmp_path_factory.mktemp("report-compare")
    path = make_compare_repo(base / "repo")
    out = base / "compare.html"
    r = luopan.open(path, create=False)
    try:
        write_report(r, out)
    finally:
        r.close()
    return out


def test_runs_compared_overlay_config_and_evals(compare_report, driver, tmp_path):
    """Two runs trained by CheckpointManager (400 logged steps, a checkpoint every 50): one chart per metric with a
    series per run holding every logged step, hover text naming run, step and value; the config table with the
    differing keys highlighted and the identical ones folded; evals per checkpoint with the best marked."""
    from .test_report_compare import DIFFERING, EVERY, RUNS, STEPS
    driver.get("about:blank")
    errors(driver)  # reading the log empties it: what an earlier test's served page logged is not this page's
    driver.get(compare_report.as_uri())
    assert driver.execute_script("return document.readyState") == "complete"
    assert errors(driver) == []
    for metric in ("loss", "grad_norm"):
        chart = f'svg[data-chart="overlay-{metric}"]'
        assert count(driver, chart) == 1
        assert count(driver, f"{chart} path.line[data-run]") == len(RUNS)  # one series per run
        for run in RUNS:
            assert count(driver, f'{chart} path.line[data-run="{run}"]') == 1
            assert count(driver, f'{chart} circle.pt[data-run="{run}"]') == STEPS  # every logged step, not 8
            assert count(driver, f'{chart} circle.pt.ckpt[data-run="{run}"]') == STEPS // EVERY
            assert count(driver, f'{chart} g.tick[data-run="{run}"]') == STEPS // EVERY
    colours = driver.execute_script(
        "return [...document.querySelectorAll('svg[data-chart=\"overlay-loss\"] path.line')]"
        ".map(p => getComputedStyle(p).stroke)")
    assert len(set(colours)) == len(RUNS)  # told apart by colour, as the legend says
    assert count(driver, '#compare ul.legend li[data-run]') == len(RUNS)
    hover = driver.execute_script("return document.querySelector('svg[data-chart=\"overlay-loss\"] "
                                  "circle.pt[data-run=\"lr-lo\"][data-step=\"123\"] title').textContent")
    assert hover.startswith("lr-lo step 123 · loss = ")
    # the same numbers as a table under the chart: one row per step, a column per run
    rows = driver.execute_script(
        "const f = document.querySelector('svg[data-chart=\"overlay-loss\"]').closest('figure');"
        "f.querySelector('details').open = true; return [...f.querySelectorAll('tbody tr')].length")
    assert rows == STEPS
    # config side by side: the differing keys highlighted, the identical ones folded under them
    differing = driver.execute_script("return [...document.querySelectorAll('table.config tr.differs')]"
                                      ".map(r => r.dataset.key)")
    assert set(differing) == DIFFERING
    bg = driver.execute_script("return getComputedStyle(document.querySelector('table.config tr.differs td'))"
                               ".backgroundColor")
    plain = driver.execute_script("return getComputedStyle(document.querySelector('table.config tr.same td'))"
                                  ".backgroundColor")
    assert bg != plain and bg not in ("rgba(0, 0, 0, 0)", "transparent")
    assert driver.execute_script("return document.querySelector('details.same').open") is False
    # checkVisibility, not getClientRects: newer Chromium hides a closed <details>' content with content-visibility,
    # whose skipped boxes still report client rects
    assert driver.execute_script("return document.querySelector('table.config tr.same').checkVisibility()") is False
    # evals per checkpoint: a row per checkpoint of each run, the best of each score marked
    for run in RUNS:
        assert count(driver, f'table.evals[data-run="{run}"] tbody tr') == STEPS // EVERY
        assert count(driver, f'table.evals[data-run="{run}"] td.best[data-metric="acc"]') == 1
    assert driver.execute_script("return document.documentElement.scrollWidth") <= WIDTH
    driver.execute_script("document.querySelectorAll('details').forEach(d => d.open = false);"
                          "document.getElementById('compare').scrollIntoView()")
    keep(driver, "report-compare.png", tmp_path)
