"""MLflow's UI on the runs a comparison logged, in a real browser: headless Chromium driven by Selenium.

The UI is started with the command and opened at the addresses `compare` prints (the port changed to a free one).
Without Chromium and its driver (Debian's `chromium` and `chromium-driver`; `.ci/run` installs them where it may)
the test says so in one line and is skipped.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from shard_ray.cli import main
from shard_ray.process_groups import stop_process_group
from tests.console import shard_ray_here
from tests.ports import free_port

TABLES = """{"tables": [
  {"name": "user_id", "rows": 200000, "dim": 32, "pooling_factor": 1},
  {"name": "item_id", "rows": 100000, "dim": 32, "pooling_factor": 4},
  {"name": "category", "rows": 300, "dim": 16, "pooling_factor": 2},
  {"name": "history", "rows": 50000, "dim": 16, "pooling_factor": 20}
]}
"""


def browser():
    """Headless Chromium under Selenium and a folder of its own for its temporary files, for the caller to remove (its
    profile's lock folder, org.chromium.Chromium.*, outlived `quit()` in /tmp, one a run; a short path, as the folder
    holds a Unix socket, whose path a pytest folder makes too long); or a skip that says what is missing and why."""
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip(
            "no chromium or chromedriver on PATH: the MLflow UI is not checked in a browser "
            "(apt-get install chromium chromium-driver; .ci/run installs them as root)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1700,950"):
        options.add_argument(argument)
    scratch = Path(tempfile.mkdtemp(prefix="shard-ray-chromium-"))
    service = Service(driver, env={**os.environ, "TMPDIR": str(scratch)})
    return webdriver.Chrome(options=options, service=service), scratch


def printed(stdout: str, prefix: str) -> str:
    """What the line of `stdout` starting with `prefix` says after it."""
    (line,) = [line for line in stdout.splitlines() if line.startswith(prefix)]
    return line.removeprefix(prefix).strip()


def wait_for(condition, what: str, timeout: float = 60.0):
    """Poll `condition` until it returns something true; that, or a failure naming `what`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.25)
    pytest.fail(f"waited {timeout:.0f} s for {what}")


@pytest.mark.slow
def test_the_ui_opens_on_the_plans_by_cost_and_shows_each_runs_chart(ray_session, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tables.json").write_text(TABLES)
    for algo in ("size_greedy", "round_robin"):
        made = main(["plan", "--tables", "tables.json", "--devices", "2", "--memory-gb", "1", "--algo", algo,
                     "--out", f"{algo}.json"])  # fmt: skip
        assert made == 0
    compared = shard_ray_here(
        capsys, "compare", "--tables", "tables.json", "--plans", "size_greedy.json", "round_robin.json",
        "--rounds", "3", "--repeats", "3", "--warmup", "1", "--out", "cmp",
    )  # fmt: skip
    assert compared.returncode == 0, compared.stderr
    table = [re.match(r"(size_greedy|round_robin) +([0-9.]+) ", line) for line in compared.stdout.splitlines()]
    costs = {found.group(1): float(found.group(2)) for found in table if found}  # the table's cost_ms column
    assert set(costs) == {"size_greedy", "round_robin"}
    port = str(free_port())
    command = printed(compared.stdout, "(with the UI started:").removesuffix(")")
    assert command.startswith("MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false ") and "--port 5000" in command
    runs_url = printed(compared.stdout, "every plan measured, by cost_ms:").replace(":5000/", f":{port}/")
    side_by_side = printed(compared.stdout, "the plans side by side:").replace(":5000/", f":{port}/")
    experiment_id = re.search(r"/experiments/(\d+)/runs", runs_url).group(1)

    driver, scratch = browser()
    ui = subprocess.Popen(
        ["bash", "-c", command.replace("--port 5000", f"--port {port}")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    shots = Path(os.environ.get("SHARD_RAY_UI_SCREENSHOTS", tmp_path))
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/health"), "the UI to answer")
        # the runs table: every plan by cost_ms, without a click; MLflow prints metrics as JavaScript numbers
        driver.get(runs_url)
        body = wait_for(lambda: _text_with(driver, ["cost_ms", "tables/size_greedy", "tables/round_robin"]), "the runs")
        assert "/runs" in driver.current_url  # not MLflow's GenAI overview
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
        plan_runs = {
            run.data.tags["mlflow.runName"]: run for run in client.search_runs([experiment_id], "tags.kind = 'plan'")
        }
        for name, cost in costs.items():
            logged = plan_runs[f"tables/{name}"].data.metrics["cost_ms"]
            assert abs(logged - cost) <= 0.005 + 1e-9  # the number the table printed, to its 2 decimals
            shown = repr(logged).removesuffix(".0")  # JavaScript prints a whole 83.0 as 83
            assert re.search(rf"(?<![\d.]){re.escape(shown)}(?![\d.])", body), f"cost_ms {shown} of {name} is not shown"
        _screenshot(driver, shots / "mlflow-runs-table.png")
        # a run's stacked per-device chart loads
        run = plan_runs["tables/size_greedy"]
        driver.get(
            runs_url.split("/#/")[0]
            + f"/#/experiments/{experiment_id}/runs/{run.info.run_id}/artifacts/device_costs.png"
            + "?workflowType=machine_learning"  # as docs/mlflow.md gives it
        )
        wait_for(
            lambda: driver.execute_script(
                "return [...document.images].some(i => i.alt === 'device_costs.png' && i.complete && i.naturalWidth > 0)"
            ),
            "device_costs.png to load",
        )
        # the comparison of the plans: both runs, their cost_ms side by side
        driver.get(side_by_side)
        wait_for(lambda: _text_with(driver, ["tables/size_greedy", "tables/round_robin", "cost_ms"]), "the comparison")
        _screenshot(driver, shots / "mlflow-compare-runs.png")
    finally:
        driver.quit()
        shutil.rmtree(scratch, ignore_errors=True)
        stop_process_group(ui, grace_s=10)
    assert ui.poll() is not None


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _text_with(driver, needles: list[str]) -> str | None:
    """The page's text once it shows every one of `needles`, else None."""
    text = driver.find_element("tag name", "body").text
    return text if all(re.search(re.escape(n), text) for n in needles) else None


def _screenshot(driver, path: Path) -> None:
    """The page as the docs show it: MLflow's assistant panel and the shared-view banner closed first."""
    for component in ("mlflow.assistant.chat_panel.close", "mlflow.experiment_page.shared_view.dismiss"):
        for button in driver.find_elements("css selector", f"button[data-component-id='{component}']"):
            button.click()
    time.sleep(0.5)  # the panel slides away
    driver.save_screenshot(str(path))
