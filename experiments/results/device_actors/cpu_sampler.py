"""Every process's CPU time while it runs: /proc sampled every 0.5 s until SIGTERM, then written to argv[1] as the
totals by kind of process and to argv[1].json as [pid, CPU s, command line] per process (a Ray worker under the
name of the first actor it ran). A process that lived less than a sample is missed."""

import json
import os
import signal
import sys
import time
from collections import Counter

TICK = os.sysconf("SC_CLK_TCK")
seen: dict[tuple[str, str], list] = {}  # (pid, start time) -> [CPU s, command line, named as an actor]


def command_line(pid: str) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode(errors="replace").strip()


def sample() -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            key, cpu = (pid, fields[19]), (int(fields[11]) + int(fields[12])) / TICK
            if key not in seen:
                seen[key] = [cpu, command_line(pid), False]
                continue
            seen[key][0] = cpu
            if not seen[key][2]:  # a Ray worker takes its actor's name once it runs one
                line = command_line(pid)
                if line.startswith("ray::") and not line.startswith("ray::IDLE"):
                    seen[key][1:] = [line, True]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            pass


def kind(line: str) -> str:
    if line.startswith("ray::"):
        return line.split()[0].split(".")[0]
    for name in ("gcs_server", "raylet", "log_monitor", "monitor.py", "dashboard.py", "default_worker.py"):
        if name in line:
            return name
    words = line.split()
    return " ".join(words[1:3]) if words and words[0].endswith("python") else (words[0] if words else "?")


stopped = False


def stop(*_: object) -> None:
    global stopped
    stopped = True


signal.signal(signal.SIGTERM, stop)
sample()
before = {key: value[0] for key, value in seen.items()}
while not stopped:
    time.sleep(0.5)
    sample()
spent = {key: value[0] - before.get(key, 0.0) for key, value in seen.items()}
with open(sys.argv[1] + ".json", "w") as f:
    json.dump([[key[0], spent[key], seen[key][1][:200]] for key in seen], f)
totals, counts = Counter(), Counter()
for key, value in seen.items():
    totals[kind(value[1])] += spent[key]
    counts[kind(value[1])] += 1
with open(sys.argv[1], "w") as f:
    for name, cpu in totals.most_common():
        f.write(f"{cpu:9.1f} s {counts[name]:5d}  {name}\n")
    f.write(f"{sum(totals.values()):9.1f} total\n")
