"""``srun`` on the simulated cluster: one job step, its tasks started on the step's hosts through the ssh
stand-in (beside this one on PATH), each with the environment a real srun gives a task: the caller's own
(``--export=ALL``, the default) plus the SLURM_* variables of the step and of the task, in the caller's working
directory. Hosts come from ``-w``, else the allocation (``SLURM_JOB_NODELIST``, as sbatch/salloc set it); task
counts from ``-n``/``--ntasks-per-node``, else the allocation's ``SLURM_NTASKS``/``SLURM_NTASKS_PER_NODE``;
tasks are laid out in blocks (Slurm's default distribution). Exit code: the largest of the tasks' (as srun's).
There is no PMI: an MPI program started here sees a world of one (srun ``--mpi`` is accepted and ignored).

Usage (what the cluster's ``bin/srun`` runs): srun_standin.py SSH [srun options] COMMAND...
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
from typing import IO

from hostlist import compress, expand, tasks_per_node

VALUED = {"-N": "nodes", "--nodes": "nodes", "-n": "ntasks", "--ntasks": "ntasks", "--ntasks-per-node": "per_node",
          "-w": "nodelist", "--nodelist": "nodelist", "--export": "export", "--mpi": "mpi", "-D": "chdir",
          "--chdir": "chdir", "-J": "job_name", "--job-name": "job_name", "--input": "input", "-i": "input",
          "-c": "cpus", "--cpus-per-task": "cpus"}
FLAGS = {"-l": "label", "--label": "label", "-K": "kill", "--kill-on-bad-exit": "kill", "-u": "unbuffered",
         "--unbuffered": "unbuffered"}


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    opts: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        word = argv[i]
        name, eq, value = word.partition("=")
        if word == "--":
            i += 1
            break
        if name in FLAGS:
            opts[FLAGS[name]] = value if eq else "1"
        elif name in VALUED:
            if not eq:
                i += 1
                value = argv[i]
            opts[VALUED[name]] = value
        elif len(word) > 2 and word[:2] in VALUED and not word.startswith("--"):  # glued: -N2
            opts[VALUED[word[:2]]] = word[2:]
        else:
            raise SystemExit(f"srun stand-in: option {word} is not simulated")
        i += 1
    return opts, argv[i:]


def layout(nodes: list[str], ntasks: int | None, per_node: int | None) -> list[int]:
    """Tasks per node, block distribution: ``ntasks`` spread as evenly as possible, the first nodes fuller."""
    if ntasks is None:
        ntasks = len(nodes) * (per_node or 1)
    if per_node is not None and ntasks > len(nodes) * per_node:
        raise SystemExit(f"srun: error: {ntasks} tasks do not fit {len(nodes)} nodes x {per_node} per node")
    base, extra = divmod(ntasks, len(nodes))
    counts = [base + (1 if i < extra else 0) for i in range(len(nodes))]
    return [c for c in counts if c]


def _relay(stream: IO[bytes], sink: IO[bytes], prefix: bytes, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            sink.write(prefix + line + (b"" if line.endswith(b"\n") else b"\n"))
            sink.flush()


def main() -> int:
    ssh, (opts, command) = sys.argv[1], parse(sys.argv[2:])
    if not command:
        print("srun: fatal: No command given to execute.", file=sys.stderr)
        return 1
    env = dict(os.environ)
    spec = opts.get("nodelist") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not spec:
        print("srun stand-in: no allocation (SLURM_JOB_NODELIST) and no -w hosts", file=sys.stderr)
        return 1
    nodes = expand(spec)
    if "nodes" in opts:
        nodes = nodes[:int(opts["nodes"])]
    ntasks = opts.get("ntasks") or (None if "nodelist" in opts or "nodes" in opts else env.get("SLURM_NTASKS"))
    per_node = opts.get("per_node") or env.get("SLURM_NTASKS_PER_NODE")
    counts = layout(nodes, int(ntasks) if ntasks else None, int(per_node) if per_node else None)
    nodes = nodes[:len(counts)]
    export = opts.get("export", "ALL")
    if export != "ALL":  # NONE, or [ALL,]NAME[=value],...: only those (besides SLURM_*) when ALL is absent
        words = export.split(",")
        base = dict(env) if "ALL" in words else {}
        for word in words:
            if word not in ("ALL", "NONE"):
                name, eq, value = word.partition("=")
                if eq:
                    base[name] = value
                elif name in env:
                    base[name] = env[name]
        env = base
    job_id = os.environ.get("SLURM_JOB_ID") or str(os.getpid())
    step_id = "0"
    step_list, total = compress(nodes), sum(counts)
    launch_ip = socket.gethostbyname(socket.gethostname())
    step = {
        "SLURM_JOB_ID": job_id, "SLURM_JOBID": job_id, "SLURM_STEP_ID": step_id, "SLURM_STEPID": step_id,
        "SLURM_JOB_NODELIST": os.environ.get("SLURM_JOB_NODELIST", step_list),
        "SLURM_NODELIST": os.environ.get("SLURM_JOB_NODELIST", step_list),
        "SLURM_JOB_NUM_NODES": os.environ.get("SLURM_JOB_NUM_NODES", str(len(nodes))),
        "SLURM_STEP_NODELIST": step_list, "SLURM_STEP_NUM_NODES": str(len(nodes)), "SLURM_NNODES": str(len(nodes)),
        "SLURM_NTASKS": str(total), "SLURM_NPROCS": str(total), "SLURM_STEP_NUM_TASKS": str(total),
        "SLURM_TASKS_PER_NODE": tasks_per_node(counts), "SLURM_STEP_TASKS_PER_NODE": tasks_per_node(counts),
        "SLURM_LAUNCH_NODE_IPADDR": launch_ip, "SLURM_SRUN_COMM_HOST": launch_ip,
        "SLURM_SUBMIT_HOST": socket.gethostname(), "SLURM_JOB_NAME": opts.get("job_name", os.path.basename(command[0])),
        "SLURM_CLUSTER_NAME": "simulated", "SLURM_CPUS_PER_TASK": opts.get("cpus", "1"),
    }
    cwd = opts.get("chdir", os.getcwd())
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    relays: list[threading.Thread] = []
    rank = 0
    for node_id, (node, count) in enumerate(zip(nodes, counts, strict=True)):
        gtids = ",".join(str(r) for r in range(rank, rank + count))
        for local in range(count):
            task = {**env, **step, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node_id),
                    "SLURMD_NODENAME": node, "SLURM_TOPOLOGY_ADDR": node, "SLURM_GTIDS": gtids,
                    "SLURM_CPUS_ON_NODE": str(count)}
            remote = (f"cd {shlex.quote(cwd)} && exec env -i "
                      + " ".join(shlex.quote(f"{k}={v}") for k, v in task.items()) + " "
                      + " ".join(shlex.quote(w) for w in command))
            stdin = None if rank == 0 and opts.get("input", "0") in ("0", "all") else subprocess.DEVNULL
            proc = subprocess.Popen([ssh, node, remote], stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            procs.append(proc)
            prefix = f"{rank}: ".encode() if "label" in opts else b""
            for stream, sink in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
                t = threading.Thread(target=_relay, args=(stream, sink, prefix, lock), daemon=True)
                t.start()
                relays.append(t)
            rank += 1

    def stop(signum: int, _: object) -> None:  # srun cancels the step: every task's session ends
        for proc in procs:
            proc.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes: dict[int, int] = {}
    while len(codes) < len(procs):
        for r, proc in enumerate(procs):
            if r not in codes and proc.poll() is not None:
                codes[r] = proc.returncode
                if proc.returncode and opts.get("kill", "0") != "0":
                    print(f"srun: error: task {r}: exited with exit code {proc.returncode}; terminating the step "
                          "(--kill-on-bad-exit)", file=sys.stderr)
                    for other in procs:
                        other.kill()
        threading.Event().wait(0.05)
    for t in relays:
        t.join()
    return max(codes.values(), default=0)


if __name__ == "__main__":
    sys.exit(main())
