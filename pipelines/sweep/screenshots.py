"""Screenshots of a sweep's run comparison in the MLflow UI, taken by a real browser:
`python -m pipelines.sweep.screenshots <parent run id> [--out DIR]`.

Opens the MLflow UI of the tracking server (`MLFLOW_TRACKING_URI`, an http(s) server without a login) in
headless Chromium (Debian's `chromium` and `chromium-driver`, driven by Selenium; nothing is downloaded) on the
comparison page of the sweep's child runs (the parallel coordinates plot of their numeric params against a
metric, then their params and metrics side by side), on the metric page of their `train_loss` and
`test_accuracy` curves, and on the metric page of every contract metric they share (contract/metrics.py: its
curves on a log axis, and each metric's latest, min and max per run). Each view is saved as a PNG in `--out`
(default `outputs/mlflow-ui`), with the page's visible text as a .txt beside it. Last stdout line:
`screenshots=<folder>`. Exit codes: 0 saved, 1 the page did not show the runs, 2 no such run, no tracking server
or no browser.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from contract import tracking
from contract.metrics import EPOCH_METRICS, FIRST_EPOCH_METRICS, TEXT_METRICS

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"  # Debian's packages
PAGE_TIMEOUT_S = 90  # the UI is a single-page app: it renders after its scripts and API calls
WINDOW = (1600, 1100)


class UsageError(RuntimeError):
    """Bad arguments or a missing browser: one line, exit 2."""


def children_of(uri: str, parent_id: str) -> tuple[str, list[Any]]:
    """(experiment id, the sweep's child runs, oldest first)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = mlflow.MlflowClient(uri)
    try:
        parent = client.get_run(parent_id)
    except MlflowException as err:
        raise UsageError(f"parent run {parent_id}: {str(err).splitlines()[0]}") from err
    experiment = parent.info.experiment_id
    children = client.search_runs([experiment], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'",
                                  order_by=["attributes.start_time ASC"])
    if not children:
        raise UsageError(f"parent run {parent_id} has no child runs (is it a sweep's parent run?)")
    return experiment, children


def browser() -> Any:
    """Headless Chromium under Selenium, with the system's chromedriver (never Selenium's own download)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        raise UsageError(f"no browser: install Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER})")
    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     f"--window-size={WINDOW[0]},{WINDOW[1]}"):
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def show(driver: Any, url: str | None, expected: list[str]) -> str:
    """Open `url` (None: stay on the page) and wait until the page's text holds every string of `expected`;
    returns the text."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    if url is not None:
        driver.get(url)
    url = driver.current_url
    text = lambda: driver.find_element(By.TAG_NAME, "body").text  # noqa: E731
    try:
        WebDriverWait(driver, PAGE_TIMEOUT_S, poll_frequency=0.5).until(lambda d: all(s in text() for s in expected))
    except TimeoutException:
        missing = [s for s in expected if s not in text()]
        raise RuntimeError(f"{url}: the page did not show {missing} within {PAGE_TIMEOUT_S} s") from None
    return text()


def close_assistant(driver: Any) -> None:
    """Close MLflow 3's assistant panel (a third of the window) when it is open: a button labelled Close."""
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        if button.is_displayed():
            button.click()
            return


def plot_metric(driver: Any, metric: str) -> None:
    """Put `metric` (alone) on the parallel coordinates plot: MLflow picks one by name order, often a system
    metric. The plot's second select holds its metrics (MLflow 3.17's Du Bois select: remove the chips, type)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    selects = driver.find_elements(By.CSS_SELECTOR, ".du-bois-light-select-multiple")
    if len(selects) < 2:
        raise RuntimeError(f"no metrics select on {driver.current_url}")
    chooser = selects[1]
    for remove in chooser.find_elements(By.CSS_SELECTOR, ".du-bois-light-select-selection-item-remove"):
        remove.click()
    chooser.click()
    search = chooser.find_element(By.CSS_SELECTOR, "input")
    search.send_keys(metric, Keys.ENTER)
    search.send_keys(Keys.ESCAPE)


def scroll_to_text(driver: Any, label: str) -> None:
    """Scroll the last visible element whose own text is `label` (a heading of the page) to the top."""
    from selenium.webdriver.common.by import By

    shown = [e for e in driver.find_elements(By.XPATH, f"//*[normalize-space(text())='{label}']") if e.is_displayed()]
    if not shown:
        raise RuntimeError(f"no '{label}' on {driver.current_url}")
    driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", shown[-1])


def shared_metrics(children: list[Any]) -> list[str]:
    """The contract's epoch metrics that every one of the runs logged (text runs add tokens_per_s)."""
    names = EPOCH_METRICS + TEXT_METRICS + FIRST_EPOCH_METRICS
    return [name for name in names if all(name in run.data.metrics for run in children)]


def metric_page(base: str, experiment: str, runs: str, metrics: list[str], scale: str = "linear") -> str:
    """The UI's metric page of `runs` (a JSON list of run ids) with the curves of `metrics` by step, on a `scale`
    (linear or log) y axis."""
    keys = json.dumps(metrics, separators=(",", ":"))
    return (f"{base}/#/metric/{metrics[0]}?runs={runs}&metric=%22{metrics[0]}%22&experiments={json.dumps([experiment])}"
            f"&plot_metric_keys={keys}&x_axis=step&y_axis_scale={scale}&show_point=true")


def capture(driver: Any, out: Path, name: str, text: str) -> None:
    driver.save_screenshot(str(out / f"{name}.png"))
    (out / f"{name}.txt").write_text(text)


def take_screenshots(uri: str, parent_id: str, out: Path) -> dict[str, str]:
    """The comparison page of the sweep's children (parallel coordinates plot, then their params and metrics side by
    side), the metric page of their `train_loss` and `test_accuracy` curves, and that of every contract metric
    they share, saved in `out`; returns each page's visible text by screenshot name."""
    experiment, children = children_of(uri, parent_id)
    names = [run.info.run_name for run in children]
    runs = json.dumps([run.info.run_id for run in children], separators=(",", ":"))
    experiments = json.dumps([experiment])
    base = uri.rstrip("/")
    out.mkdir(parents=True, exist_ok=True)
    driver = browser()
    texts = {}
    try:
        texts["compare_runs"] = show(driver, f"{base}/#/compare-runs?runs={runs}&experiments={experiments}",
                                     [*names, "Parallel Coordinates Plot", "Parameters", "Metrics"])
        close_assistant(driver)
        plot_metric(driver, "test_accuracy")
        texts["compare_runs"] = show(driver, None, ["test_accuracy"])
        capture(driver, out, "compare_runs", texts["compare_runs"])
        scroll_to_text(driver, "Parameters")
        texts["compare_runs_table"] = texts["compare_runs"]
        capture(driver, out, "compare_runs_table", texts["compare_runs"])
        texts["metric_curves"] = show(driver, metric_page(base, experiment, runs, ["train_loss", "test_accuracy"]),
                                      [f"{name} (test_accuracy)" for name in names])
        capture(driver, out, "metric_curves", texts["metric_curves"])
        shared = shared_metrics(children)  # a legend entry "<run> (<metric>)" per curve; log: bytes beside fractions
        texts["all_metrics"] = show(driver, metric_page(base, experiment, runs, shared, "log"),
                                    [f"{name} ({metric})" for name in names for metric in shared])
        close_assistant(driver)
        capture(driver, out, "all_metrics", texts["all_metrics"])
    finally:
        driver.quit()
    return texts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rtp screenshots", description=__doc__.split("\n")[0])
    parser.add_argument("parent_run_id")
    parser.add_argument("--out", type=Path, default=Path("outputs/mlflow-ui"))
    args = parser.parse_args(argv)
    uri = tracking.tracking_uri()
    try:
        if not uri.startswith(("http://", "https://")):
            raise UsageError(f"MLFLOW_TRACKING_URI={uri}: the UI needs a tracking server (mlflow server), not a store")
        tracking.check_reachable(uri)
        take_screenshots(uri, args.parent_run_id, args.out)
    except (UsageError, tracking.TrackingUnavailable) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"screenshots={args.out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
