"""The recommended store under concurrent trials, and what an analyst sees: a PostgreSQL server (Debian's,
started here on 127.0.0.1) behind `infra/mlflow_server.sh` (served artifacts, 127.0.0.1) receives a sweep
whose trials log two at a time over HTTP; then Debian's chromium, headless under Selenium, opens the
MLflow UI and finds the experiment, its runs and a per-round metric chart with one point per round."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psutil
import pytest
import yaml

from fedsweep.loading import load_sweep
from fedsweep.sweep import run_sweep
from tests.conftest import config_dict

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
ROUNDS = 4
# the server's worker processes (tests/conftest.py's mlflow_server): two serve the two trials that write at once;
# the script's default, 4, took 34-43 s to answer /health against 20 s for 2 on a loaded 2-core machine
MLFLOW_WORKERS = 2


@pytest.fixture(scope="module")
def logged_sweep(ray_session, mlflow_server, tmp_path_factory):
    url = mlflow_server.url
    tmp = tmp_path_factory.mktemp("ui-sweep")
    body = config_dict(
        algorithm={"local_lr": {"grid": [0.1, 0.05]}}, rounds=ROUNDS, eval_every=1,
        tracking={"experiment": "ui-test", "tracking_uri": url, "log_plot": True}, resources=None,
    )
    body["sweep"] = {"name": "ui", "max_concurrent_trials": 2, "seeds": [0, 1], "storage_path": str(tmp / "ray_results")}
    (tmp / "ui.yaml").write_text(yaml.safe_dump(body))
    out = run_sweep(load_sweep(tmp / "ui.yaml"), verbose=0)
    return url, out


def test_server_listens_on_loopback_only(mlflow_server):
    port, proc = mlflow_server.port, mlflow_server.proc
    family = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} | {proc.pid}
    listening = [c for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert all(c.pid in family for c in listening if c.pid is not None)


def test_concurrent_trials_lose_nothing_on_the_server(logged_sweep):
    from mlflow import MlflowClient

    url, out = logged_sweep
    assert out["errors"] == 0 and len(out["results"]) == 4
    c = MlflowClient(url)
    runs = c.search_runs([c.get_experiment_by_name("ui-test").experiment_id])
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(runs) == 5 and len(children) == 4
    assert all(r.info.status == "FINISHED" for r in runs)
    for r in children:  # every round's point arrived, from trials writing at the same time
        assert [m.step for m in c.get_metric_history(r.info.run_id, "global_accuracy")] == list(range(ROUNDS + 1))
        assert [m.step for m in c.get_metric_history(r.info.run_id, "local_train_loss")] == list(range(1, ROUNDS + 1))
        assert "plots" in {a.path for a in c.list_artifacts(r.info.run_id)}


@pytest.fixture
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail("the UI check needs Debian's chromium and chromium-driver: apt-get install chromium chromium-driver "
                    "(`make test` installs them when it runs as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def body(browser) -> str:
    return browser.find_element("tag name", "body").text


def waiter(browser, tmp_path: Path):
    """``wait(condition, what)``: the condition's value once truthy; after 90 s a failure naming ``what``,
    with what the page shows instead (and a screenshot, timeout.png)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    until = WebDriverWait(browser, 90, poll_frequency=1).until

    def wait(condition, what: str):
        try:
            return until(condition)
        except TimeoutException:
            browser.save_screenshot(str(tmp_path / "timeout.png"))
            pytest.fail(f"the UI did not show {what} in 90 s; it shows:\n{body(browser)[:2000]}")

    return wait


def test_ui_shows_experiment_runs_and_a_metric_chart(logged_sweep, browser, tmp_path):
    from mlflow import MlflowClient

    url, _ = logged_sweep
    c = MlflowClient(url)
    exp = c.get_experiment_by_name("ui-test")
    runs = c.search_runs([exp.experiment_id])
    child = next(r for r in runs if "mlflow.parentRunId" in r.data.tags)
    wait = waiter(browser, tmp_path)

    browser.get(f"{url}/#/experiments/{exp.experiment_id}/runs")
    # the count can show before the table's rows (a loaded machine, 2026-11-27): both are waited for
    def listed(d):
        text = body(d)
        return text if f"{len(runs)} matching runs" in text and "ui" in text.splitlines() else None

    text = wait(listed, f"'{len(runs)} matching runs' and the sweep's parent run 'ui'")
    browser.save_screenshot(str(tmp_path / "runs.png"))
    assert "ui-test" in text and "Training runs" in text  # the experiment and its runs table
    # (the sweep's parent run 'ui' is a row of its own, its trials nested under it)

    browser.get(f"{url}/#/experiments/{exp.experiment_id}/runs/{child.info.run_id}/model-metrics")
    chart = ("//*[normalize-space(text())='global_accuracy']/ancestor::*[.//*[contains(@class,'js-plotly-plot')]][1]"
             "//*[contains(@class,'js-plotly-plot')]")
    # charts render only on screen, and 20 metrics do not fit one: filter them as an analyst would
    search = wait(lambda d: d.find_elements("css selector", "input[placeholder='Search metric charts']"), "the chart search box")
    search[0].send_keys("global_accuracy")
    plots = wait(lambda d: d.find_elements("xpath", chart), "a global_accuracy chart")
    points = wait(lambda d: len(plots[0].find_elements("css selector", "path.point")) == ROUNDS + 1 or None,
                  f"{ROUNDS + 1} points on the global_accuracy chart")
    browser.save_screenshot(str(tmp_path / "metrics.png"))
    assert points and child.info.run_name in body(browser)
    assert "Step" in plots[0].text  # x axis: the round


def test_ui_shows_the_sweep_report_on_the_parent_run(logged_sweep, browser, tmp_path):
    """The analyst's way in: the sweep's parent run, its artifacts, report/comparison.png drawn as an image.
    With $FEDSWEEP_SCREENSHOTS set, the screenshot is also copied there (how docs/report_in_mlflow.png was made)."""
    from mlflow import MlflowClient

    url, out = logged_sweep
    exp = MlflowClient(url).get_experiment_by_name("ui-test")
    wait = waiter(browser, tmp_path)

    def named(text: str):
        return lambda d: [e for e in d.find_elements("xpath", f"//*[normalize-space(text())='{text}']") if e.is_displayed()]

    browser.set_window_size(1400, 1000)
    browser.get(f"{url}/#/experiments/{exp.experiment_id}/runs/{out['parent_run_id']}/artifacts")
    wait(named("report"), "the report folder among the parent run's artifacts")[0].click()
    wait(named("comparison.png"), "report/comparison.png")[0].click()
    # the artifact viewer draws the file it fetched (a blob: URL) as an image of the figure's own width
    image = wait(lambda d: [i for i in d.find_elements("tag name", "img")
                            if i.is_displayed() and int(i.get_attribute("naturalWidth") or 0) >= 600],
                 "the comparison figure drawn")
    assert image
    browser.save_screenshot(str(tmp_path / "report.png"))
    if os.environ.get("FEDSWEEP_SCREENSHOTS"):
        shutil.copy(tmp_path / "report.png", Path(os.environ["FEDSWEEP_SCREENSHOTS"]) / "report_in_mlflow.png")
    for name in ("table.md", "table.csv", "clients.png"):  # the rest of the report beside it
        assert named(name)(browser), name
