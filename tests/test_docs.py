"""The documentation: the MkDocs site builds without a warning, and README.md stays a short front page whose links hold."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from pages import code_blocks, page_block
from pymdownx.slugs import slugify

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
MKDOCS = str(Path(sys.executable).parent / "mkdocs")  # the console script `make setup` installs
# The site's heading anchors (mkdocs.yml's toc slugify), which are GitHub's too.
HEADING_SLUG = slugify(case="lower")
MARKDOWN_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# MkDocs serves only docs/, so the figures the docs show are copies of what the experiments wrote.
FIGURE_COPIES = {
    "docs/images/benchmark.png": "experiments/results/benchmark/benchmark.png",
    "docs/images/scaling.png": "experiments/results/scaling/scaling.png",
}


def test_the_docs_site_builds_strictly(tmp_path):
    """`--strict` turns every warning into a failure: a broken link or anchor, a page missing from the nav."""
    # Material prints a banner about its successor on every build; it is no warning about these docs.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    built = subprocess.run(
        [MKDOCS, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    assert (tmp_path / "site" / "commands" / "index.html").is_file()


def test_the_readmes_commands_parse_and_read_only_files_written_above_them():
    """A new user pastes the README's commands top to bottom: each parses as `shard-ray` parses it, and every file one
    reads is written by a block above it, a heredoc or another command's --out. (docs/own-tables.md, which runs the
    same steps, is run as written by tests/test_own_tables.py.)"""
    from shard_ray.cli import build_parser

    written: set[str] = set()
    for block in code_blocks(README):
        if block.startswith("cat > "):
            written.add(shlex.split(block.splitlines()[0])[2])
        for line in (line for line in block.splitlines() if line.startswith("shard-ray ")):
            argv = shlex.split(line)[1:]
            args = build_parser(argv[0]).parse_args(argv)
            flags = vars(args)
            reads = [flags.get("tables"), flags.get("plan"), *(flags.get("plans") or ())]
            missing = [name for name in reads if name is not None and name not in written]
            assert not missing, f"README: `{line}` reads {missing}, which no line above it writes"
            written.add(flags.get("out"))


def test_the_readme_is_a_front_page():
    lines = len(README.read_text().splitlines())
    assert lines <= 260, f"README.md has {lines} lines; the rest belongs under docs/"


def _anchors(markdown: Path) -> set[str]:
    """The anchors of a Markdown file's headings (indented code lines never start with '#')."""
    headings = re.findall(r"^#+ (.+)$", markdown.read_text(), flags=re.MULTILINE)
    return {HEADING_SLUG(heading.replace("`", ""), "-") for heading in headings}


def test_every_relative_link_in_the_readme_resolves():
    """On GitHub the README links into docs/ and cluster/: each file must exist, and each anchor be a heading."""
    broken = []
    for target in MARKDOWN_LINK.findall(README.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (REPO / path) if path else README
        if not file.is_file():
            broken.append(f"{target}: no file {path}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path or 'README.md'}")
    assert not broken, broken


def test_the_docs_figures_are_the_experiments_figures():
    for copy, original in FIGURE_COPIES.items():
        assert (REPO / copy).read_bytes() == (REPO / original).read_bytes(), f"copy {original} to {copy} again"


def _experiment(script: str) -> ModuleType:
    """An entry point of experiments/, imported from its file as `python experiments/<name>.py` runs it."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_job_on_the_clusters_page_makes_commands_shard_ray_takes(tmp_path, monkeypatch):
    """docs/clusters.md's jobs as bash expands them, each made into the `shard-ray` command lines its entry point
    runs with the shipped configs: every line parses, no flag unknown or missing its value. (One of the jobs runs
    on a Ray head in tests/test_cluster.py; running all of them there took minutes.)"""
    from shard_ray.cli import build_parser

    jobs = tmp_path / "jobs"
    jobs.mkdir()
    # `ray` as a bash function writing the arguments it was called with, one per line, a file a call
    capture = 'n=0; ray() { n=$((n + 1)); printf "%s\\n" "$@" > "$JOBS/$n"; }'
    script = "\n".join([capture, page_block("clusters.md", "ray job submit")])
    done = subprocess.run(
        ["bash", "-c", script], cwd=REPO, env={**os.environ, "JOBS": str(jobs), "HOME": str(tmp_path)},
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    submitted = [(jobs / name).read_text().splitlines() for name in sorted(os.listdir(jobs), key=int)]
    assert len(submitted) == 6
    monkeypatch.chdir(REPO)  # a job runs in the folder `--working-dir .` uploads: the configs' paths are relative to it
    for arguments in submitted:
        python, script_path, *argv = arguments[arguments.index("--") + 1 :]
        assert python == "python" and script_path.startswith("experiments/")
        for command in _experiment(script_path).commands(argv):
            try:
                build_parser(command[0]).parse_args(command)
            except SystemExit:
                raise AssertionError(f"{script_path} {' '.join(argv)} makes `shard-ray {' '.join(command)}`") from None


def report_kept_gpu_plans(kept: str) -> subprocess.CompletedProcess:
    """`experiments/gpu_truth.py --report` on a kept folder of plans measured device by device, as docs/gpu.md runs it."""
    plans = sorted(str(p.relative_to(REPO)) for p in (REPO / kept).glob("*.json"))
    done = subprocess.run(
        [sys.executable, "experiments/gpu_truth.py", "--report", f"{kept}/plans_log.jsonl.gz", "--plans", *plans],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done


def test_the_gpu_pages_plans_of_8_devices_are_what_their_kept_log_says():
    """docs/gpu.md's table of 8-device plans measured device by device on an H200: the report of the kept log, as
    the page runs it, gives the ratios the page prints."""
    done = report_kept_gpu_plans("experiments/results/gpu_h200_plans")
    page = (REPO / "docs/gpu.md").read_text()
    ratios = re.findall(r"^(\w+)\.cost_search / TorchRec's, 6 rounds: ([\d.]+x \[[\d.]+, [\d.]+\])", done.stdout, re.M)
    assert len(ratios) == 3, done.stdout
    for _, ratio in ratios:
        assert ratio in page, f"{ratio} is not on docs/gpu.md"
    # TorchRec's replicating devices, measured over priced when planned and by today's models; the correlation
    for name in ("criteo_kaggle", "ranking_model"):
        then, now = re.search(
            rf"^{name}\.torchrec: .*by device ([\d.]+-[\d.]+)\).*\(([\d.]+-[\d.]+)\);", done.stdout, re.M
        ).groups()
        assert f"{now.replace('-', 'x to ')}x" in page.replace("\n   ", " ") and then.replace("-", "x to ") in page
    then_rho, now_rho = re.search(r"Spearman ([\d.]+) when planned, ([\d.]+) by today", done.stdout).groups()
    assert f"went from {then_rho} to {now_rho}" in page.replace("\n   ", " ")


def test_the_gpu_pages_second_run_with_aa_twins_is_what_its_kept_log_says():
    """docs/gpu.md's fresh run of the 8-device plans with A/A twins: the page prints the report's ratios, and no
    twin is separated from its original."""
    done = report_kept_gpu_plans("experiments/results/gpu_h200_plans_rerun")
    page = (REPO / "docs/gpu.md").read_text()
    against_torchrec = re.findall(
        r"^\w+\.cost_search / TorchRec's, \d+ rounds: ([\d.]+x \[[\d.]+, [\d.]+\])", done.stdout, re.M
    )
    twins = re.findall(r"^\w+\.cost_search_twin / its original \(A/A\), \d+ rounds: (.*)$", done.stdout, re.M)
    assert len(against_torchrec) == 3 and len(twins) == 3, done.stdout
    for ratio in against_torchrec + twins:
        assert ratio.removesuffix(" separated").strip() in page, f"{ratio} is not on docs/gpu.md"
    assert not any(t.endswith("separated") for t in twins), twins
    now_rho, then_rho = re.search(r"Spearman ([\d.]+) when planned, ([\d.]+) by today", done.stdout).groups()[::-1]
    assert f"is {now_rho} by today's models ({then_rho} by the prices" in page.replace("\n   ", " ")


@pytest.mark.slow
def test_the_clusters_pages_fit_on_few_devices_is_what_the_kept_records_say(tmp_path):
    """docs/clusters.md's link fitted on at most 4 emulated devices and its error at 8 and 16: the page prints what
    `experiments/comm_over_hosts.py --reprice` finds in the kept records."""
    done = subprocess.run(
        [sys.executable, "experiments/comm_over_hosts.py", "--out", str(tmp_path),
         "--reprice", "experiments/results/comm_over_hosts/comm_over_hosts.json.gz"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = " ".join((REPO / "docs/clusters.md").read_text().split())
    fit = re.search(
        r"^25 Mbit/s links: fitted ([\d.]+) Mbit/s .*, one link a host \(median errors: a link a device ([\d.]+)%, "
        r"one a host ([\d.]+)%\), to (\d+) all-to-alls",
        done.stdout,
        re.M,
    )
    assert fit, done.stdout
    rate, own, shared, count = fit.groups()
    assert f"{count} all-to-alls of 2x1, 2x2 and 4x1: {rate} Mbit/s, one link a host" in page
    assert f"(median error {round(float(shared))}%; as a link per device {round(float(own))}%)" in page
    for layout in ("2x1", "2x2", "4x1", "4x2", "8x1", "4x4", "8x2"):
        slowest = re.search(rf"^24 Mbit/s, {layout}: .*\n  slowest device of each .*$", done.stdout, re.M).group(0)
        columns = [re.search(rf"measured/{price} ([\d.]+)", slowest.splitlines()[1]).group(1)
                   for price in ("fitted", "now", "torchrec")]  # fmt: skip
        hosts, per_host = layout.split("x")
        assert f"| {hosts} x {per_host} | {' | '.join(columns)} |" in page, (layout, columns)
    for devices in (8, 16):
        line = re.search(rf"^25 Mbit/s, {devices} devices .*$", done.stdout, re.M).group(0)
        found = {
            price: re.search(rf"{price}: median error ([\d.]+)% a device, ([\d.]+)% a collective, .* ([-\d.]+)", part)
            for price, part in zip(("fitted", "now", "torchrec"), line.split("; ")[1:])
        }
        collective = " / ".join(f"{found[p].group(2)}%" for p in ("fitted", "now", "torchrec"))
        device = " / ".join(f"{found[p].group(1)}%" for p in ("fitted", "now", "torchrec"))
        rho = " / ".join(found[p].group(3) for p in ("fitted", "now", "torchrec"))
        assert f"| {collective} | {device} | {rho} |" in page, (devices, collective, device, rho)


def test_the_gpu_pages_training_step_is_what_its_kept_log_says():
    """docs/gpu.md's training step around the 8-device plans' shards: the report of the kept log, as the page runs
    it, gives each plan's share of the procedure's figure and its ratios to TorchRec's plan by both measures."""
    kept = "experiments/results/gpu_h200_step"
    plans = sorted(str(p.relative_to(REPO)) for p in (REPO / "experiments/results/gpu_h200_plans_rerun").glob("*.json"))
    done = subprocess.run(
        [sys.executable, "experiments/gpu_truth.py", "--report", f"{kept}/fp32_log.jsonl.gz", "--plans", *plans],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    page = (REPO / "docs/gpu.md").read_text()
    shares = re.findall(
        r"adds to a step ([\d.]+)x what the procedure measures \(quartiles ([\d.]+-[\d.]+)", done.stdout
    )
    ratios = re.findall(r"/ TorchRec's, (?:procedure|step), \d+ rounds: ([\d.]+x \[[\d.]+, [\d.]+\])", done.stdout)
    assert len(shares) == 9 and len(ratios) == 12, done.stdout
    for share, quartiles in shares:
        assert f"| {share} ({quartiles}) |" in page, f"{share} ({quartiles}) is not on docs/gpu.md"
    for ratio in ratios:
        assert ratio in page, f"{ratio} is not on docs/gpu.md"


@pytest.mark.slow(seconds=15)
def test_the_python_pages_code_plans_as_the_plan_command_does_and_hands_torchrec_its_plan(tmp_path):
    """docs/python.md's code blocks, pasted into one script and run by the environment's Python as a user's training
    script would: the plan file it writes is the one `shard-ray plan` writes of the same tables (the script's own,
    written to a table file after it), devices and seed, and the plan reaches TorchRec as a ShardingPlan and comes back from it."""
    page = "\n".join(b for b in code_blocks(REPO / "docs" / "python.md") if not b.startswith("shard-ray "))
    tables_after = "from shard_ray.workload.tables import save_tables\nsave_tables('my_model.json', tables)\n"
    (tmp_path / "page.py").write_text(page + "\n" + tables_after)
    env = {**os.environ, "SHARD_RAY_HOME": str(tmp_path / "home")}
    done = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "page.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "simulated plan cost: " in done.stdout and "| sharding type |" in done.stdout, done.stdout
    flags = ["--tables", "my_model.json", "--devices", "4", "--memory-gb", "16", "--algo", "cost_search"]
    planned = subprocess.run([str(REPO / ".venv" / "bin" / "shard-ray"), "plan", *flags, "--out", "cli.json"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-2000:]
    from_python, from_cli = (json.loads((tmp_path / name).read_text()) for name in ("plan.json", "cli.json"))
    assert from_python["shards"] == from_cli["shards"] and from_python["tables"] == from_cli["tables"]
    assert from_python["settings"]["tables_digest"] == from_cli["settings"]["tables_digest"]
    # TorchRec's planner's plan, through a ShardingPlan and read back, is what `plan --algo torchrec` writes, priced by
    # the models that priced shard-ray's; its file one the page's commands take
    torchrec = subprocess.run([str(REPO / ".venv" / "bin" / "shard-ray"), "plan", *flags[:-1], "torchrec", "--out",
                               "torchrec.json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert torchrec.returncode == 0, torchrec.stderr[-2000:]
    current, planned = (json.loads((tmp_path / name).read_text()) for name in ("current.json", "torchrec.json"))
    assert sorted(map(json.dumps, current["shards"])) == sorted(map(json.dumps, planned["shards"]))
    assert current["algorithm"] == "current" and current["shards"] != from_python["shards"]
    assert current["estimate"]["predicted"] == planned["estimate"]["predicted"]
    assert f"priced: current {planned['estimate']['predicted']['cost_ms']:.3f} ms" in done.stdout
    from shard_ray.cli import build_parser

    for line in page_block("python.md", "shard-ray compare").splitlines():  # as `shard-ray` parses them
        argv = shlex.split(line)[1:]
        flags = vars(build_parser(argv[0]).parse_args(argv))
        assert "current.json" in (flags.get("plans") or [flags.get("incumbent")]), line
