"""The run report (``gem-train report RUN_DIR``): a real (tiny) run, its page opened in
headless Chromium, and the BBS balance checked against the batches the loader yields."""

import html
import io
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gem_data import ShardedBatchLoader, SyntheticConfig, write_synthetic_dataset
from gem_train.cli import main, run
from gem_train.report import RunDirectoryError, _group_lengths, _rank_step_costs, write_report
from rich.console import Console

from conftest import small_train_config

CHROMIUM = shutil.which("chromium")

# Appended to a copy of the page: once it has loaded, writes how many <img> there are and
# how many decoded to a picture, for --dump-dom to show.
_RENDER_CHECK = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const decoded = images.filter((image) => image.complete && image.naturalWidth > 0);
  const marker = document.createElement("div");
  marker.id = "render-check";
  marker.textContent = `images=${images.length} decoded=${decoded.length} widths=` +
    images.map((image) => image.naturalWidth).join(",");
  document.body.appendChild(marker);
});
</script>"""


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A real two-variant run of the trainer on 1024 samples (about 3 s on 2 CPU cores) and
    what it printed."""
    root = tmp_path_factory.mktemp("report")
    config = small_train_config(root)
    printed = io.StringIO()
    run(config, console=Console(file=printed, width=200))
    return config, printed.getvalue()


def _copy_run(config, destination):
    shutil.copytree(config.output_dir, destination, ignore=shutil.ignore_patterns("checkpoints"))
    return destination


def test_a_run_writes_its_report_and_prints_the_path(finished_run):
    config, printed = finished_run
    report = Path(config.output_dir) / "report.html"
    assert printed.rstrip().splitlines()[-1] == f"report: {report}"
    page = report.read_text(encoding="utf-8")
    for heading in ("Eval on held-out users", "Loss and eval NE", "Training data"):
        assert heading in page
    assert "Per-rank balance with and without BBS" in page
    # A one-rank run shows what 2, 4 and 8 ranks would get: their whole first epoch of
    # 1024 samples in batches of 128, 4, 2 and 1 steps.
    assert "This run trained on one rank" in page
    for ranks, steps in ((2, 4), (4, 2), (8, 1)):
        assert f"<tr><td>{ranks}</td><td>{steps}</td>" in page
    assert '"batch_size": 128' in html.unescape(page)  # the config, in full
    assert "No MFU: the run had no GPU" in page
    # Self-contained: every picture inline, nothing fetched from elsewhere.
    assert all(
        src.startswith("data:image/png;base64,") for src in re.findall(r'src="([^"]*)"', page)
    )
    assert not re.search(r"""(?:src|href)=["'](?:[a-z]+:)?//""", page)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_the_page_renders_every_plot_in_a_headless_browser(finished_run, tmp_path):
    """Profiled variant included: the per-region table and bar chart appear, and Chromium
    decodes every inline PNG to a picture."""
    config, _ = finished_run
    run_dir = _copy_run(config, tmp_path / "run")
    (run_dir / "gem" / "trace.json").write_text('{"traceEvents": []}')
    regions = [
        {"region": "sequence_tower", "forward_ms": 3.5, "backward_ms": 7.25, "ms": 10.75,
         "model_tflop": 0.002, "mfu": 0.31},
        {"region": "embeddings", "forward_ms": 1.0, "backward_ms": 2.0, "ms": 3.0,
         "model_tflop": 0.0, "mfu": None},
    ]  # fmt: skip
    profile = {"step_ms": 20.5, "regions": regions, "trace": "trace.json"}
    (run_dir / "gem" / "profile.json").write_text(json.dumps(profile))

    page = write_report(run_dir).read_text(encoding="utf-8")
    assert "Per-region profile: GEM" in page and "sequence_tower" in page
    assert '<a href="gem/trace.json">' in page
    images = len(re.findall(r"<img ", page))
    # loss, eval NE, lengths, balance, time split, regions
    assert images == 6
    checked = run_dir / "render-check.html"
    checked.write_text(page.replace("</body>", f"{_RENDER_CHECK}</body>"), encoding="utf-8")
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=10000",
         "--dump-dom", checked.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    marker = re.search(r'id="render-check">images=(\d+) decoded=(\d+) widths=([\d,]*)<', dom)
    assert marker, f"the page did not finish loading in Chromium: {dom[-2000:]}"
    assert int(marker[1]) == images and int(marker[2]) == images, marker[0]
    assert all(int(width) >= 400 for width in marker[3].split(",")), marker[0]


def test_multi_rank_run_shows_its_own_balance_and_the_measured_one(finished_run, tmp_path):
    """A 2-rank GPU run (summary and metrics as the trainer writes them on 2 H200s): the
    balance is the run's own world size, MFU is shown, local MFU needs a 1-rank run."""
    config, _ = finished_run
    run_dir = _copy_run(config, tmp_path / "run")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["world_size"] = 2
    (run_dir / "summary.json").write_text(json.dumps(summary))
    for variant in ("gem", "no_sequence"):
        path = run_dir / variant / "metrics.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        for line in lines:
            if line["split"] == "train":
                line.update(mfu=0.05, mfu_measured=0.06, peak_mem_gib=3.5, token_balance=1.25)
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    page = html.unescape(write_report(run_dir).read_text(encoding="utf-8"))
    assert "The run's 2 ranks over its first 4 steps" in page  # 1024 samples / 2 / 128
    assert "(token_balance): 1.250" in page
    assert "<td>5.0%</td><td>–</td><td>–</td><td>6.0%</td>" in page  # E2E, local, scaling
    assert "2 ranks: local MFU is that of a 1-GPU run" in page


def test_missing_data_leaves_the_rest_of_the_report(finished_run, tmp_path):
    config, _ = finished_run
    run_dir = _copy_run(config, tmp_path / "run")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["config"]["data"]["directory"] = str(tmp_path / "removed")
    (run_dir / "summary.json").write_text(json.dumps(summary))
    page = write_report(run_dir).read_text(encoding="utf-8")
    assert f"No histogram: the train data is no longer at {tmp_path / 'removed' / 'train'}" in page
    assert "Not computed: the train data is no longer at" in page
    assert len(re.findall(r"<img ", page)) == 3  # loss, eval NE, time split


@pytest.mark.parametrize(("world_size", "batch_size"), [(1, 96), (2, 96), (3, 64)])
def test_balance_costs_are_those_of_the_loaders_batches(tmp_path, world_size, batch_size):
    """The report's per-rank costs (from lengths and the loader's plan) equal the cost model
    summed over the batches ShardedBatchLoader really yields, with and without BBS. 7000
    samples in row groups of 500: full pools of 32 batches, merges of 3 and 2 sub-batches
    (batch 96 = 3 x 32, 64 = 2 x 32 with sub_batch_size 32), a partial pool at the end."""
    info = write_synthetic_dataset(
        SyntheticConfig(max_seq_len=48, num_users=1000, num_items=500, num_ads=50),
        tmp_path / "train",
        num_samples=7000,
        num_shards=3,
        workers=1,
        row_group_size=500,
        progress=False,
    )
    lengths = _group_lengths(info)
    per_mode = {}
    for balance in ("none", "bbs"):
        costs = _rank_step_costs(
            info.directory,
            lengths,
            batch_size=batch_size,
            seed=5,
            world_size=world_size,
            balance=balance,
            max_steps=10_000,
        )
        expected = []
        for rank in range(world_size):
            loader = ShardedBatchLoader(
                info.directory,
                batch_size,
                shuffle=True,
                seed=5,
                rank=rank,
                world_size=world_size,
                drop_last=True,
                balance=balance,
                pin_memory=False,
            )
            expected.append(
                [loader.cost_model(b.sequence_offsets.diff().numpy()).sum() for b in loader]
            )
        np.testing.assert_allclose(costs, np.array(expected).T, rtol=1e-12)
        assert len(costs) > 32, "covers more than one pool"
        per_mode[balance] = costs
    assert not np.allclose(per_mode["none"], per_mode["bbs"])


def test_report_command(finished_run, tmp_path, capsys):
    config, _ = finished_run
    run_dir = _copy_run(config, tmp_path / "run")
    assert main(["report", str(run_dir)]) == 0
    assert capsys.readouterr().out == f"{run_dir / 'report.html'}\n"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (None, "does not exist"),
        ("mkdir", "is not a finished gem-train run: no summary.json"),
        ("touch", "is not a directory"),
    ],
    ids=["missing", "not a run", "a file"],
)
def test_report_of_a_non_run_is_one_line_naming_the_argument(tmp_path, capsys, make, expected):
    path = tmp_path / "somewhere"
    if make:
        getattr(path, make)()
    with pytest.raises(SystemExit) as exit_info:
        main(["report", str(path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gem-train report: error: RUN_DIR: {path} {expected}"), err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    with pytest.raises(RunDirectoryError, match=f"^run_dir: {re.escape(str(path))} "):
        write_report(path)
