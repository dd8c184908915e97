"""Speed across hosts (issue 23): ``python -m unidist.bench collectives --compare`` on the simulated cluster,
unidist beside the raw engine, for each backend, and one table of the ratios.

    sudo .tox/horovod/bin/python tests/cluster/bench_cluster.py [--out DIR] [--sizes 8,64K,2M,32M]

One rank on each of two hosts (h1, h2), so every byte crosses the veth pair and the bridge: the path a
cluster's network takes, at a memory-copy's speed rather than a NIC's. The engines come from the interpreter
running this file (the horovod tox env has torch, mpi4py and Horovod; DeepSpeed lives in its own env: pass
``--python-deepspeed .tox/deepspeed/bin/python``). Each backend runs with its own launcher form of
tests/cluster/jobs.py: mpi under mpiexec, torch under torchrun (c10d), horovod under mpiexec, deepspeed under
its runner (pdsh). Prints the machine, then a markdown table per backend and the ratios unidist/raw.
Not a test: the figures go into benchmarks/RESULTS.md ("Across hosts") by hand, with the machine they came from.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # this tree is measured, as benchmarks/regenerate.sh does
sys.path.insert(0, str(ROOT / "tests"))  # jobs.run_job checks the engines with tests/helpers.py

from fakehosts import Cluster  # noqa: E402
from jobs import LAUNCHES, run_job  # noqa: E402

FORMS = {"mpi": "mpiexec", "torch": "torchrun-c10d", "horovod": "horovod-under-mpiexec", "deepspeed": "deepspeed-pdsh"}


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    return f"{cpu}, {os.cpu_count()} cores, THP {thp}, load {os.getloadavg()[0]:.2f}, {platform.platform()}"


def measure(cluster: Cluster, backends: list[str], sizes: str, ops: str, out: Path,
            python_deepspeed: str = "") -> str:
    """Run the sweep on ``cluster``'s h1 and h2 for each backend; the markdown report (rows also to ``out``)."""
    entry = cluster.shared / "bench_entry.py"  # a script path: every launcher form takes one
    entry.write_text("import runpy\nrunpy.run_module('unidist.bench', run_name='__main__')\n")
    report = []
    for backend in backends:
        launch = LAUNCHES[FORMS[backend]]
        json_path = cluster.shared / f"bench-{backend}.json"
        py = python_deepspeed if backend == "deepspeed" and python_deepspeed else sys.executable
        argv = [str(entry), "collectives", "--compare", "--sizes", sizes, "--ops", ops, "--json", str(json_path)]
        if py != sys.executable:  # the deepspeed runner starts `python`: put that env's bin first
            cluster.profile["PATH"] = f"{Path(py).parent}{os.pathsep}{cluster.profile['PATH']}"
        job = run_job(cluster, launch, {"h1": 1, "h2": 1}, argv, {"PYTHONPATH": str(ROOT)}, 900)
        if job.code != 0 or not json_path.exists():
            report.append(f"## {backend} ({launch.name}): failed, exit {job.code}\n{job.output[-3000:]}")
            continue
        doc = json.loads(json_path.read_text())
        (out / f"{backend}.json").write_text(json.dumps(doc, indent=1))
        report.append(f"\n## {backend} ({launch.name}, h1:1 + h2:1 over veth), {job.seconds:.0f} s\n"
                      "| op | bytes | unidist us | raw us | unidist/raw |\n|---|---|---|---|---|")
        report.extend(f"| {r['op']} | {r['bytes']} | {r['time_us']:.1f} | {r['raw_time_us']:.1f} | {r['ratio']:.2f} |"
                      for r in doc["rows"] if "raw_time_us" in r)
    return "\n".join(report)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/var/tmp/unidist-cluster-bench"))
    parser.add_argument("--sizes", default="8,64K,2M,32M")
    parser.add_argument("--ops", default="allreduce,allgather,broadcast")
    parser.add_argument("--backends", default=",".join(FORMS))
    parser.add_argument("--python-deepspeed", default="", help="an interpreter with DeepSpeed, if not this one")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine()}")
    with Cluster(2) as cluster:
        report = measure(cluster, args.backends.split(","), args.sizes, args.ops, args.out, args.python_deepspeed)
    print(report)
    return 1 if "failed, exit" in report else 0


if __name__ == "__main__":
    sys.exit(main())
