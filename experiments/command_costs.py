"""Benchmark: what a command costs around its work, with a local Ray and joined to a running one.

    python experiments/command_costs.py --out experiments/results/command_costs
    python experiments/command_costs.py --previous 04ae4a7     # that commit's code side by side, alternately

Runs, as a user types them (`python -m shard_ray.cli`, the console script's code, a fresh process each):
- `plan --algo size_greedy` on Criteo Kaggle's 26 tables for 2 devices: the whole command;
- `compare` of that plan and `lookup_greedy`'s for 6 rounds, once on the local Ray the command starts and once
  joined to a running head (`ray start --head --block`, started and stopped here by its process group): the whole
  command and its phases, from when each line of its output appeared: start (to its `ray:` line: imports and
  Ray), gang (to `measuring ...`: pricing and the gang's start), measuring (to the last round's line), report
  (the table, the chart, MLflow: to the last line) and exit (to the process's end);
- joined, that `compare` once more right after: it takes the gang the first left on the head
  (`shard_ray.profiling.keeper`), where the release keeps gangs. Before each release's joined runs the head's kept
  gang, if any, is stopped (untimed), so that the first starts a gang and another release finds the devices free.
Each release runs once unrecorded first (its MLflow store made), then `--repeats` times, the releases in turn;
the medians are reported. `--previous COMMIT` runs that commit's code too, from a git worktree put first on
PYTHONPATH, in the same environment. Writes command_costs.json and command_costs.md to --out.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from releases import checkout_of, is_commit

from shard_ray.arguments import Parser
from shard_ray.cli.flags import a_folder_to_write
from shard_ray.io import write_atomic, write_json
from shard_ray.process_groups import stop_process_group

REPO = Path(__file__).resolve().parents[1]
TABLES = REPO / "experiments" / "tables" / "criteo_kaggle.json"
PHASES = ("start", "gang", "measuring", "report", "exit")


def timed_lines(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[list[tuple[float, str]], float]:
    """Run `shard-ray ARGV`; each line of its output with the seconds since the start when it appeared, and the
    seconds to its end. A failing command stops the benchmark with its output."""
    began = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "shard_ray.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**env, "PYTHONUNBUFFERED": "1"},
        cwd=cwd,
    )
    lines = [(time.perf_counter() - began, line.rstrip()) for line in process.stdout]
    code = process.wait()
    took = time.perf_counter() - began
    if code != 0:
        raise SystemExit(f"shard-ray {' '.join(argv)} failed ({code}):\n" + "\n".join(line for _, line in lines))
    return lines, took


def phases(lines: list[tuple[float, str]], took: float) -> dict[str, float]:
    """A compare's seconds per phase (PHASES) and in all, from the times its lines appeared."""
    ray = next(t for t, line in lines if line.startswith("ray:"))
    measuring = next(t for t, line in lines if line.startswith("measuring "))
    last_round = [t for t, line in lines if line.startswith("round ")][-1]
    last = lines[-1][0]
    marks = [0.0, ray, measuring, last_round, last, took]
    return {"total": took} | {name: b - a for name, a, b in zip(PHASES, marks, marks[1:])}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_head(env: dict[str, str], temp: Path) -> tuple[subprocess.Popen, str]:
    """A Ray head of 2 CPUs on a free port, as docs/clusters.md starts one; its process and address."""
    port = free_port()
    head = subprocess.Popen(
        [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
         "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return head, f"127.0.0.1:{port}"
        except OSError:
            time.sleep(0.5)
    stop_process_group(head, 15)
    raise SystemExit("the Ray head did not come up in 2 minutes")


def measure_release(code: Path | None, work: Path, env: dict[str, str], address: str) -> dict[str, dict]:
    """One repetition of every command with the code at `code` (None: this checkout's)."""
    env = {**env, "PYTHONPATH": str(code)} if code else env
    plans = []
    result: dict[str, dict] = {}
    for algorithm in ("size_greedy", "lookup_greedy"):
        out = work / f"{algorithm}.json"
        _, took = timed_lines(
            ["plan", "--tables", str(TABLES), "--devices", "2", "--memory-gb", "8", "--algo", algorithm,
             "--out", str(out)], env, work,
        )  # fmt: skip
        plans.append(str(out))
        if algorithm == "size_greedy":
            result["plan"] = {"total": took}
    compare = ["compare", "--tables", str(TABLES), "--plans", *plans, "--rounds", "6", "--out", str(work / "cmp")]
    result["compare, local Ray"] = phases(*timed_lines(compare, {**env, "RAY_ADDRESS": ""}, work))
    joined = {**env, "RAY_ADDRESS": address}
    release_kept_gang(joined)
    result["compare, joined"] = phases(*timed_lines(compare, joined, work))
    result["compare, joined again"] = phases(*timed_lines(compare, joined, work))
    release_kept_gang(joined)
    return result


def release_kept_gang(env: dict[str, str]) -> None:
    """Stop the gang a command left on the head (this checkout's code does it)."""
    script = "import ray; ray.init(); from shard_ray.profiling.keeper import release_kept_gang; release_kept_gang()"
    subprocess.run([sys.executable, "-c", script], env={**env, "PYTHONPATH": str(REPO)}, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def medians(runs: list[dict[str, dict]]) -> dict[str, dict[str, float]]:
    return {
        command: {part: statistics.median(run[command][part] for run in runs) for part in runs[0][command]}
        for command in runs[0]
    }


def markdown(results: dict[str, dict[str, dict[str, float]]], repeats: int) -> list[str]:
    lines = [
        f"Seconds, medians of {repeats} runs each (releases in turn); compare's phases from when its lines appeared.",
        "",
        "| release | command | total | " + " | ".join(PHASES) + " |",
        "|---|---|---|" + "---|" * len(PHASES),
    ]
    for release, commands in results.items():
        for command, parts in commands.items():
            cells = [f"{parts[p]:.2f}" if p in parts else "" for p in PHASES]
            lines.append(f"| {release} | {command} | {parts['total']:.2f} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="recorded runs of each release (default %(default)s)")
    parser.add_argument("--previous", help="a commit whose code runs the same commands, alternately")
    parser.add_argument(
        "--out",
        type=a_folder_to_write,
        default="experiments/results/command_costs",
        help="folder (default %(default)s)",
    )
    args = parser.parse_args()
    if args.previous and not is_commit(args.previous):
        parser.error(f"--previous {args.previous}: no such commit in this repository")
    with tempfile.TemporaryDirectory(prefix="command-costs-") as folder, contextlib.ExitStack() as stack:
        temp = Path(folder)
        # a token of the benchmark's own: Ray turns authentication on where ~/.ray/auth_token exists
        env = {**os.environ, "SHARD_RAY_HOME": str(temp / "home"), "RAY_AUTH_MODE": "token",
               "RAY_AUTH_TOKEN": secrets.token_hex(16)}  # fmt: skip
        releases: dict[str, Path | None] = {"this checkout": None}
        if args.previous:
            releases[f"previous ({args.previous})"] = stack.enter_context(checkout_of(args.previous, temp / "previous"))
        head, address = start_head(env, temp / "ray")
        try:
            runs: dict[str, list[dict]] = {name: [] for name in releases}
            for repeat in range(args.repeats + 1):  # the first unrecorded: each release's MLflow store made
                for name, code in releases.items():
                    work = temp / name.split()[0]  # one folder, so one MLflow store, per release
                    work.mkdir(exist_ok=True)
                    run = measure_release(code, work, env, address)
                    print(f"{'warm-up' if repeat == 0 else f'run {repeat}'} {name}: {run}", flush=True)
                    if repeat > 0:
                        runs[name].append(run)
        finally:
            stop_process_group(head, 15)
    results = {name: medians(r) for name, r in runs.items()}
    out = Path(args.out)
    write_json(out / "command_costs.json", {"medians": results, "runs": runs})
    write_atomic(out / "command_costs.md", "\n".join(markdown(results, args.repeats)) + "\n")
    print("\n".join(markdown(results, args.repeats)))
    print(f"wrote {out / 'command_costs.md'} and {out / 'command_costs.json'}")


if __name__ == "__main__":
    main()
