"""Study and sweep reports: the HTML pages of a real search.py study (SQLite and journal storages) and of a
train.py multirun, optuna-dashboard serving those studies over HTTP, and the pages as a browser shows them."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import optuna
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from plotly.offline import get_plotlyjs

from adls_lightning.search.storage import open_storage
from tests.helpers import assert_one_line_error, run_entry_points, tiny_run

ROOT = Path(__file__).resolve().parents[1]
TRIALS = 3
NAS_STUDY = "nas-acc-tpe"
MP_STUDY = "mixed_precision-integer-acc_bits-tpe"
CHROMIUM = next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
)


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PROJECT_ROOT": str(ROOT), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_imdb_dir, cache_dir) -> dict[str, Path]:
    """A NAS study in SQLite, a two-objective mixed-precision study in a journal file (search.py, 3 trials each)
    and a 3-job train.py multirun over the learning rate, by the scripts' entry points in one process (what the
    reports read is what the runs write, not how they were started); their folders."""
    base = tmp_path_factory.mktemp("reports")
    folders = {"sqlite": base / "nas", "journal": base / "mp", "multirun": base / "multirun"}
    common = tiny_run(tiny_imdb_dir, cache_dir)
    commands = [
        ["search.py", f"hydra.sweep.dir={folders['sqlite']}", "search=nas", f"hydra.sweeper.n_trials={TRIALS}",
         "hydra.sweeper.search_space.num_hidden_layers=[1,2]", "hydra.sweeper.search_space.hidden_size=[16,32]",
         "hydra.sweeper.search_space.num_attention_heads=[2]", "hydra.sweeper.search_space.intermediate_size=[32]",
         *common],
        ["search.py", f"hydra.sweep.dir={folders['journal']}", "search=mixed_precision", "model=tiny_random",
         "search/objective=acc_bits", "search/storage=journal", f"hydra.sweeper.n_trials={TRIALS}", *common],
        ["train.py", "-m", f"hydra.sweep.dir={folders['multirun']}", "model=tiny_random", "logger=none", *common,
         "model.optimizer.lr=0.001,0.01,0.1"],
    ]  # fmt: skip
    run_entry_points(commands)
    return folders


def storage_of(runs: dict[str, Path], kind: str) -> tuple[str, str]:
    """(storage as optuna-dashboard and Optuna take it, study name)."""
    if kind == "sqlite":
        return f"sqlite:///{runs['sqlite'] / NAS_STUDY}.db", NAS_STUDY
    return str(runs["journal"] / f"{MP_STUDY}.journal"), MP_STUDY


def figure_titles(page: str) -> list[str]:
    return re.findall(r"<h2>([^<]*)</h2><div class='figure'>", page)


def table_rows(page: str, table_id: str) -> list[list[str]]:
    table = re.search(rf"<table class='sortable' id='{table_id}'>(.*?)</table>", page, re.S).group(1)
    body = table.split("<tbody>", 1)[1]
    return [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", body)]


def test_study_report_of_an_sqlite_study(runs, tmp_path):
    db = runs["sqlite"] / f"{NAS_STUDY}.db"
    proc = ok(run("-m", "adls_lightning.reports.study", str(db), f"out={tmp_path / 'report'}"))
    assert proc.stdout.strip() == f"Report written to {tmp_path / 'report' / 'index.html'}"
    page = (tmp_path / "report" / "index.html").read_text()
    # self-contained: plotly.js inline, nothing loaded from elsewhere
    assert get_plotlyjs() in page and not re.search(
        r"<(script|link)[^>]+(src|href)=", page.replace(get_plotlyjs(), "")
    )
    titles = figure_titles(page)
    assert titles[:2] == ["Optimisation history: val/acc", "Parallel coordinates: val/acc"]
    assert titles[2:] in ([], ["Parameter importances: val/acc"])  # none when the sampled params all agree
    study = optuna.load_study(study_name=NAS_STUDY, storage=f"sqlite:///{db}")
    rows = table_rows(page, "trials")
    assert [int(r[0]) for r in rows] == [t.number for t in study.trials] == list(range(TRIALS))
    for row, trial in zip(rows, study.trials):
        overrides = yaml.safe_load(
            Path(trial.user_attrs["output_dir"], ".hydra", "overrides.yaml").read_text()
        )
        shown = [o for o in overrides if not o.startswith("++search.trial.")]
        assert " ".join(shown).replace("'", "&#x27;") in row, row
        assert float(row[2]) == pytest.approx(trial.value, abs=1e-6)
    # the best trial's command line composes the configuration its job trained
    best = study.best_trial
    command = re.search(r"<pre><code>python train.py (.*?)</code></pre>", page).group(1)
    args = command.replace("&quot;", '"').replace("&#x27;", "'").split(" ")
    assert args[:2] == ["--config-name", "search"]
    overrides = [a.strip('"') for a in args[2:]]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(ROOT / "conf")):
        rerun = compose("search", overrides)
    recorded = OmegaConf.load(Path(best.user_attrs["output_dir"], ".hydra", "config.yaml"))
    assert OmegaConf.to_container(rerun.model) == OmegaConf.to_container(recorded.model)
    assert OmegaConf.to_container(rerun.data) == OmegaConf.to_container(recorded.data)
    assert rerun.callbacks.optuna_pruning is None


@pytest.fixture(scope="module")
def pages(runs, tmp_path_factory) -> dict[str, Path]:
    """The journal study's report and the multirun's sweep report, as the commands write them: the folder of each
    page. Shared by the tests of their content and the browser's test (a report command is a process start)."""
    base = tmp_path_factory.mktemp("pages")
    commands = {
        "study": ["-m", "adls_lightning.reports.study", storage_of(runs, "journal")[0]],
        "sweep": ["-m", "adls_lightning.reports.sweep", f"sweep={runs['multirun']}"],
    }
    for name, args in commands.items():
        (base / name).mkdir()  # an existing empty folder is a report's to write in
        ok(run(*args, f"out={base / name}"))
    return {name: base / name for name in commands}


def test_study_report_of_a_two_objective_journal_study_has_its_pareto_front(runs, pages):
    journal, name = storage_of(runs, "journal")
    page = (pages["study"] / "index.html").read_text()
    titles = figure_titles(page)
    assert titles[0] == "Pareto front"
    assert (
        "Optimisation history: val/acc" in titles and "Optimisation history: quant/avg_weight_bits" in titles
    )
    study = optuna.load_study(study_name=name, storage=open_storage(journal))
    assert len(table_rows(page, "trials")) == len(study.trials) == TRIALS
    assert f"Pareto front ({len(study.best_trials)} trials)" in page


def test_sweep_report_of_a_multirun(runs, pages):
    page = (pages["sweep"] / "index.html").read_text()
    assert figure_titles(page) == ["val/acc vs model.optimizer.lr"]
    rows = table_rows(page, "jobs")
    assert [(r[0], float(r[1])) for r in rows] == [("0", 0.001), ("1", 0.01), ("2", 0.1)]
    for row in rows:  # the main metric's column follows the swept one: each job's own metrics.json
        metrics = json.loads((runs["multirun"] / row[0] / "metrics.json").read_text())
        assert float(row[2]) == pytest.approx(metrics["val/acc"], abs=1e-6)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_optuna_dashboard_serves_a_search_study(runs, kind):
    storage, name = storage_of(runs, kind)
    port = free_port()
    # the documented command (docs/search.md): optuna-dashboard <storage>
    server = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "optuna-dashboard"),
            storage,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline, studies = time.monotonic() + 180, None
        while studies is None and time.monotonic() < deadline:
            try:
                studies = get_json(f"http://127.0.0.1:{port}/api/studies")["study_summaries"]
            except OSError:
                assert server.poll() is None, "optuna-dashboard exited"
                time.sleep(0.5)
        assert [s["study_name"] for s in studies] == [name]
        served = get_json(f"http://127.0.0.1:{port}/api/studies/{studies[0]['study_id']}")["trials"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    stored = optuna.load_study(study_name=name, storage=open_storage(storage))
    assert len(served) == TRIALS
    assert [(t["number"], t["values"], t["state"]) for t in served] == [
        (t.number, t.values, "Complete") for t in stored.trials
    ]


@pytest.mark.parametrize(
    ("args", "contains"),
    [
        (["no-such-study", "out=OUT"], "source=no-such-study: no such study file"),
        (["STUDY"], "out: missing"),
        (["STUDY", "out=/proc/report"], "out=/proc/report: cannot create folders in /proc"),
        (["STUDY", "out=OUT", "colour=red"], "colour: unknown option"),
    ],
)
def test_study_report_bad_input_is_refused_and_writes_nothing(runs, tmp_path, args, contains):
    from adls_lightning.errors import ConfigError
    from adls_lightning.tools.study_report import write_report

    db = str(runs["sqlite"] / f"{NAS_STUDY}.db")
    argv = [a.replace("STUDY", db).replace("OUT", str(tmp_path / "out")) for a in args]
    with pytest.raises(ConfigError, match=re.escape(contains)):
        write_report(argv)
    assert not (tmp_path / "out").exists()


def test_report_bad_input_is_one_line(tmp_path):
    proc = run("-m", "adls_lightning.reports.sweep", f"sweep={tmp_path}", f"out={tmp_path / 'out'}")
    assert_one_line_error(proc, contains=f"sweep={tmp_path}: no job folder with a run record")
    proc = run("-m", "adls_lightning.reports.study", str(tmp_path / "no.db"), f"out={tmp_path / 'out'}")
    assert_one_line_error(proc, contains=f"source={tmp_path / 'no.db'}: no such study file")
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(
    CHROMIUM is None, reason="no headless Chromium on this machine (apt-get install chromium)"
)
def test_reports_as_a_browser_shows_them(pages, tmp_path):
    """Headless Chromium opens each page (the journal study's, the multirun's): every figure is drawn (plotly's
    SVG with its traces' points), the table holds every trial, and the screenshot is not blank."""
    import numpy as np
    from matplotlib.image import imread

    for name, rows in {"study": TRIALS, "sweep": 3}.items():
        url = (pages[name] / "index.html").as_uri()
        browser = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                   "--window-size=1280,2000", "--virtual-time-budget=10000"]  # fmt: skip
        dom = subprocess.run(
            [*browser, "--dump-dom", url], capture_output=True, text=True, timeout=300
        ).stdout
        figures = re.split(r"<div class=\"figure\">", dom)[1:]
        assert len(figures) == len(figure_titles((pages[name] / "index.html").read_text())) >= 1
        for figure in figures:
            assert 'class="main-svg"' in figure  # plotly.js ran and drew it
            # its data drawn: markers and bars (class "point"), parallel coordinates' lines ("js-line")
            assert re.search(r'class="(point|js-line)\b', figure), figure[:2000]
        body = re.search(r"<tbody>(.*?)</tbody>", dom.split('class="sortable"', 1)[1], re.S).group(1)
        assert body.count("<tr>") == rows
        shot = tmp_path / f"{name}.png"
        subprocess.run([*browser, f"--screenshot={shot}", url], capture_output=True, timeout=300, check=True)
        pixels = imread(shot)[..., :3]
        assert pixels.std() > 0.05  # text, figures, tables: far from a blank page
        assert (np.abs(pixels[..., 2] - pixels[..., 0]) > 0.2).any()  # plotly's coloured traces are there


def test_a_report_redraws_its_own_earlier_page_and_refuses_the_others(tmp_path):
    """Each report's out: its own earlier page is redrawn (run twice: the second page is the new one); the other
    report's page or another command's files are refused in one line, and left as they were. A hand-made sweep
    (one job) and study (two trials): no training."""
    from adls_lightning.errors import ConfigError
    from adls_lightning.tools import report, study_report

    job = tmp_path / "sweep" / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    (job / "metrics.json").write_text('{"val/acc": 0.5}')
    db = tmp_path / "s.db"
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{db}")
    study.optimize(lambda trial: trial.suggest_float("x", 0, 1), n_trials=2)
    sweep_out, study_out = tmp_path / "sweep_report", tmp_path / "study_report"
    for _ in range(2):  # the second run redraws the first one's page
        assert report.write_report([f"sweep={job.parent}", f"out={sweep_out}"]) == sweep_out / "index.html"
        assert study_report.write_report([str(db), f"out={study_out}"]) == study_out / "index.html"
    (job / "metrics.json").write_text('{"val/acc": 0.75}')
    report.write_report([f"sweep={job.parent}", f"out={sweep_out}"])
    assert "<td class=num>0.75</td>" in (sweep_out / "index.html").read_text()

    pages = {p: p.read_bytes() for p in (sweep_out / "index.html", study_out / "index.html")}
    with pytest.raises(
        ConfigError, match=f"out={study_out}: holds index.html not written by adls_lightning.reports.sweep"
    ):
        report.write_report([f"sweep={job.parent}", f"out={study_out}"])
    with pytest.raises(
        ConfigError, match=f"out={sweep_out}: holds index.html not written by adls_lightning.reports.study"
    ):
        study_report.write_report([str(db), f"out={sweep_out}"])
    (sweep_out / "notes.txt").write_text("mine")
    with pytest.raises(
        ConfigError, match=re.escape(f"out={sweep_out}: holds notes.txt; valid: a new or empty")
    ):
        report.write_report([f"sweep={job.parent}", f"out={sweep_out}"])
    assert {p: p.read_bytes() for p in pages} == pages
