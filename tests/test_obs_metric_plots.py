"""Metric plots follow the keys a run reports: a character model's held-out bits per character gets its own
plot (lower is better) in `hfleet report` and in `hfleet ui`, with the joint model, each site and each site
alone; names are escaped, unknown plot names are refused.

The run folders are written as `hfleet run` leaves them (worker-<site>-<i> and baseline-<site> records in
metrics.jsonl, summary.json with site_baselines); the plots are drawn by the real matplotlib and the pages
opened in headless Chromium.
"""

from __future__ import annotations

import httpx
import pytest

from hybridfleet.obs.metric_plots import draw_metric, final_values, joint_series, lower_is_better, reported_sections
from hybridfleet.obs.report import sections_for, write_report
from hybridfleet.obs.runinfo import load_run
from tests.browser import chromium_page, pixel_stddev, save_screenshot
from tests.test_ui import in_process_ui
from tests.test_ui_runs import XSS, completed_summary, write_run

BPC_TITLE = "Held-out bits per character (lower is better): joint model, each site, each site alone"


def _charlm_metrics(site_name: str = "cloud") -> list[dict]:
    """Two sites x one worker and each site alone: test_bpc falls from 4 towards 2, the training loss per site
    differs (each site's own rows), the baselines end worse than the joint model."""
    records = []
    for step in range(10, 41, 10):
        for rank, site in enumerate(("hospital", site_name)):
            records.append({"event": "metrics", "process": f"worker-{site}-0", "site": site, "rank": rank,
                            "step": step, "elapsed_s": step / 10, "loss": 2.0 / step + rank,
                            "test_bpc": 4.0 - step / 20, "sent": step * 100, "received": step * 100})
            records.append({"event": "metrics", "process": f"baseline-{site}", "site": site, "rank": 0,
                            "step": step, "elapsed_s": step / 10, "loss": 2.0 / step, "test_bpc": 4.2 - step / 40 + rank})
    records.append({"event": "metrics", "process": "worker-hospital-0", "site": "hospital", "rank": 0, "step": 40,
                    "final": True, "test_bpc": 2.0, "elapsed_s": 4.2, "sent": 4000, "received": 4000})
    return records


def _charlm_summary(job: str) -> dict:
    summary = completed_summary(job)
    return {**summary, "test_accuracy": None, "test_accuracy_source": None,
            "site_alone_accuracy": {"hospital": None, "cloud": None}}


@pytest.fixture
def charlm_run(tmp_path):
    root = tmp_path / "runs"
    run = write_run(root, "charlm", "r1-bpc", summary=_charlm_summary("charlm"), metrics=_charlm_metrics())
    return root, run


def test_metric_direction_comes_from_its_name():
    assert lower_is_better("test_bpc") and lower_is_better("loss") and lower_is_better("val_perplexity")
    assert lower_is_better("test_accuracy") is False and lower_is_better("f1") is False
    assert lower_is_better("val.error") and lower_is_better("test_accuracy_loss")  # any word that says lower
    # bookkeeping is no metric, even where a word merely contains a metric's letters
    for key in ("sent", "elapsed_s", "step", "rounds_applied", "pushes_accepted", "site_lan_bytes", "train_rows"):
        assert lower_is_better(key) is None, key


def test_a_run_reporting_bits_per_character_gets_a_bpc_plot_and_no_accuracy_plot(charlm_run):
    # Prepare
    _, run_dir = charlm_run
    run = load_run(run_dir)

    # Execute
    sections = [key for key, _, _ in sections_for(run)]
    joint = joint_series(run, "test_bpc")
    final, alone = final_values(run, "test_bpc")

    # Assert: loss first, then bpc, then the run's own sections; the joint curve is the workers' mean per step
    assert reported_sections(run) == ["loss", "test_bpc"]
    assert sections == ["loss", "test_bpc", "bytes", "phases", "stragglers", "events"]
    assert joint == [(10, 3.5), (20, 3.0), (30, 2.5), (40, 2.0)]
    assert final == 2.0  # rank 0's final report
    assert alone == {"cloud": pytest.approx(4.2 - 1.0 + 1), "hospital": pytest.approx(4.2 - 1.0)}


def test_the_bpc_plot_draws_the_joint_model_and_each_site_alone_with_lower_is_better_on_its_axis(charlm_run):
    # Prepare
    from matplotlib.figure import Figure

    _, run_dir = charlm_run
    run = load_run(run_dir)
    bpc_ax, loss_ax = Figure().add_subplot(), Figure().add_subplot()

    # Execute
    drew_bpc = draw_metric("test_bpc")(bpc_ax, run)
    drew_loss = draw_metric("loss")(loss_ax, run)

    # Assert: every worker evaluates the one joint model, so the sites' bpc curves are one curve;
    # the training losses differ by site, so each site has its own curve beside their mean
    assert drew_bpc and drew_loss
    assert [line.get_label() for line in bpc_ax.get_lines()] == ["joint model (all sites)", "cloud alone",
                                                                 "hospital alone"]
    assert "bits per character" in bpc_ax.get_ylabel() and "lower is better" in bpc_ax.get_ylabel()
    assert list(bpc_ax.get_lines()[0].get_ydata()) == [3.5, 3.0, 2.5, 2.0]
    assert [line.get_label() for line in loss_ax.get_lines()] == ["mean over the sites' workers", "workers at cloud",
                                                                  "workers at hospital", "cloud alone",
                                                                  "hospital alone"]


def test_the_report_of_a_bpc_run_shows_the_bpc_plot_and_summary_row_escaped(tmp_path):
    # Prepare: a site whose name is markup
    run_dir = write_run(tmp_path / "runs", "charlm", "hostile", summary=_charlm_summary("charlm"),
                        metrics=_charlm_metrics(site_name=XSS))

    # Execute
    page = write_report(run_dir).read_text()

    # Assert: the bpc section and its PNG, its final value in the summary, no raw markup
    assert BPC_TITLE in page and 'id="test_bpc"' in page
    assert (run_dir / "report" / "test_bpc.png").stat().st_size > 1000
    assert not (run_dir / "report" / "accuracy.png").exists()  # no accuracy was reported
    assert "joint held-out bits per character (test_bpc)</td><td>2.0000" in page
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt; alone: test_bpc" in page


def test_the_ui_serves_the_bpc_plot_and_refuses_a_plot_name_that_is_no_metric(charlm_run):
    # Prepare
    root, _ = charlm_run

    # Execute
    with in_process_ui(root) as url:
        page = httpx.get(url + "/runs/charlm/r1-bpc")
        bpc = httpx.get(url + "/runs/charlm/r1-bpc/plots/test_bpc.png")
        unknown = httpx.get(url + "/runs/charlm/r1-bpc/plots/sent.png")
        hostile = httpx.get(url + "/runs/charlm/r1-bpc/plots/" + "%3Cscript%3E.png")

    # Assert
    assert page.status_code == 200 and BPC_TITLE in page.text
    assert 'src="/runs/charlm/r1-bpc/plots/test_bpc.png"' in page.text and "plots/accuracy.png" not in page.text
    assert "joint held-out bits per character (test_bpc)" in page.text
    assert bpc.status_code == 200 and bpc.headers["content-type"] == "image/png"
    assert unknown.status_code == 404 and hostile.status_code == 404
    assert "<script>" not in hostile.text


def test_the_ui_run_page_of_a_bpc_run_shows_the_drawn_bpc_plot_in_chromium(charlm_run):
    # Prepare
    root, _ = charlm_run
    with in_process_ui(root) as url, chromium_page() as page:
        # Execute
        page.goto(url + "/runs/charlm/r1-bpc")
        page.wait_for_load_state("networkidle")
        captions = page.locator("#plots figcaption").all_inner_texts()
        widths = page.eval_on_selector_all("#plots img", "imgs => imgs.map(i => i.naturalWidth)")
        bpc_plot = page.locator("#plots img[src$='/test_bpc.png']").screenshot()
        summary = page.locator("#summary").inner_text()
        save_screenshot(page, "run-page-bpc")
    # Assert
    assert captions[:2] == ["Training loss (lower is better): joint model, each site, each site alone", BPC_TITLE]
    assert len(widths) == 6 and all(w == 800 for w in widths), widths
    assert pixel_stddev(bpc_plot) > 10
    assert "joint held-out bits per character (test_bpc)\t2" in summary


def test_compare_overlays_bits_per_character_when_no_run_reports_an_accuracy(charlm_run):
    # Prepare: a second bpc run, and a digits run with an accuracy beside them
    from hybridfleet.ui.compare import compared_metric

    root, first = charlm_run
    second = write_run(root, "charlm", "r2-bpc", summary=_charlm_summary("charlm"), metrics=_charlm_metrics())
    digits = write_run(root, "digits", "r3-acc", summary=completed_summary("digits"))

    # Execute
    bpc_only = compared_metric([load_run(first), load_run(second)])
    mixed = compared_metric([load_run(first), load_run(digits)])
    with in_process_ui(root) as url:
        plot = httpx.get(url + "/compare.png?run=charlm/r1-bpc&run=charlm/r2-bpc")

    # Assert
    assert bpc_only == "test_bpc" and mixed == "accuracy"
    assert plot.status_code == 200 and plot.headers["content-type"] == "image/png"
    assert pixel_stddev(plot.content) > 10
