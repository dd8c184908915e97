"""What the launcher told this process: a pure function of an environment mapping.

Each launcher family is one row of ``LAUNCHERS``: the variables it sets, whether it is MPI-like (its ranks
share an MPI world, so mpi4py can carry a rendezvous) and, for the launchers ``unidist launch`` drives, how to
spell its command line. Which backend a family implies is the backends' own fact (their records in
``unidist.registry``). Detection walks the rows in the documented order and the first family whose rank
variable is present wins; the selector, the torch rendezvous, the CLI and the tests read these rows. Nothing
here imports an engine or touches MPI.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from unidist.errors import HostsError, LaunchEnvironmentError
from unidist.hosts import expand_nodelist, tasks_per_node

__all__ = ["LAUNCHERS", "NO_LAUNCHER", "Command", "Family", "LaunchInfo", "detect", "family", "find_program",
           "programs", "script_args", "slurm_port", "slurm_step_hosts"]


NO_LAUNCHER = "none"  # ``LaunchInfo.launcher`` of a plain ``python script.py``: no family matches


@dataclass(frozen=True)
class LaunchInfo:
    """Topology as the launcher announced it (engines may refine local/node numbers after start)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: str = NO_LAUNCHER
    attempt: int = 0  # the launcher's restart count (torchrun --max-restarts): 0 on the first run

    @property
    def launched(self) -> bool:
        return self.launcher != NO_LAUNCHER


@dataclass(frozen=True)
class Command:
    """How ``unidist launch`` starts N processes with this launcher, on this host and on several.

    ``args`` follow the program and precede the script and its arguments; ``{n}`` is the process count,
    ``{python}`` this interpreter, ``{port}`` a free TCP port, ``{mpi}`` srun's ``--mpi=`` option.
    ``hosts_args`` are the same for the launcher's multi-host form (None: it has none), which may also use
    ``{hosts}`` (``h1:2,h2:2``), ``{first}`` (the first host: rank 0's), ``{nnodes}``, ``{ssh}`` (the ssh
    program) and, when ``per_host`` (the launcher is started once on every host, over ssh), ``{slots}`` (that
    host's processes), ``{node_rank}`` (its place in the host list, 0 first), ``{run_id}`` (one id shared by the
    job's launchers) and ``{hostfile}``: every host in the ``hostfile`` style (``"slots"`` or ``"mpich"``, see
    ``unidist.hosts.hostfile_text``), a file written on that host by the ssh command line before its launcher
    starts, since hosts have a /tmp of their own (removed when the launcher ends).

    Started per host, a launcher gets unidist's own list of variables over ssh, plus those whose names start with
    one of ``exports`` and those of the ``env_file`` (the variable that names it, its default name): what the
    launcher's own multi-host runner would have carried to the nodes, so a job set up for that runner keeps them.
    """

    programs: tuple[str, ...]  # the first one found beside the interpreter or on PATH is used
    args: tuple[str, ...]
    hosts_args: tuple[str, ...] | None = None
    per_host: bool = False
    hostfile: str | None = None
    exports: tuple[str, ...] = ()
    env_file: tuple[str, str] | None = None
    answers: str = "--version"  # the option the program answers without starting anything (info --check runs it)

    def argv(self, program: str, n: int, python: str, port: int | None, rest: list[str], mpi: str = "--mpi=none"
             ) -> list[str]:
        values = {"n": str(n), "python": python, "port": str(port), "mpi": mpi}
        return [program, *(a.format(**values) for a in self.args), *rest]

    def hosts_argv(self, program: str, values: Mapping[str, str], rest: list[str]) -> list[str]:
        """The multi-host form, its placeholders filled from ``values`` (see the class docstring)."""
        if self.hosts_args is None:
            raise HostsError(f"{program} has no multi-host form in unidist.launch.LAUNCHERS")
        return [program, *(a.format(**values) for a in self.hosts_args), *rest]


@dataclass(frozen=True)
class Family:
    """One launcher family: the variables it sets (``marker`` must be present for it to match), whether it is
    MPI-like, and its command line when ``unidist launch`` can drive it."""

    name: str
    rank: str
    size: tuple[str, ...]
    local_rank: str | None = None
    local_size: str | None = None
    node_rank: str | None = None
    marker: tuple[str, ...] = ()
    master_addr: str | None = None
    master_port: str | None = None
    attempt: str | None = None  # the variable counting restarts of the whole job
    mpi_like: bool = False
    command: Command | None = None


# Order is the detection order (docs/launchers/index.md): torchrun, horovodrun, deepspeed, MPI launchers, SLURM, plain.
LAUNCHERS: tuple[Family, ...] = (
    Family("torchrun", "RANK", ("WORLD_SIZE",), "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
           marker=("TORCHELASTIC_RUN_ID",), master_addr="MASTER_ADDR", master_port="MASTER_PORT",
           attempt="TORCHELASTIC_RESTART_COUNT",
           # on several hosts: one torchrun per host over ssh, one c10d rendezvous on the first host (node ranks
           # follow torch's sort of the hosts' names)
           command=Command(("torchrun",), ("--standalone", "--nproc_per_node", "{n}"),
                           ("--nnodes", "{nnodes}", "--nproc_per_node", "{slots}", "--rdzv_backend", "c10d",
                            "--rdzv_endpoint", "{first}:{port}", "--rdzv_id", "{run_id}"), per_host=True,
                           answers="--help")),
    # Horovod's gloo controller: horovodrun's MPI mode does not recognise every MPI (the mpich wheel's hydra
    # prints no "MPICH" in its version); for MPI, start with mpiexec and UNIDIST_BACKEND=horovod.
    Family("horovodrun", "HOROVOD_RANK", ("HOROVOD_SIZE",), "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
           "HOROVOD_CROSS_RANK",
           command=Command(("horovodrun",), ("-np", "{n}", "--gloo", "-H", "localhost:{n}", "{python}"),
                           ("-np", "{n}", "--gloo", "-H", "{hosts}", "{python}"))),
    # --num_gpus also sets the process count with DeepSpeed's CPU accelerator; a free port avoids a clash
    # with another job on the default 29500; --no_local_rank keeps the script's argv as given.
    # On several hosts: `deepspeed --no_ssh` on every host over ssh, as torchrun, not DeepSpeed's pdsh runner (pdsh
    # is rarely installed, and its runner re-quotes the script's arguments for a remote shell). Each host's runner
    # reads the whole world from the hostfile and runs its --node_rank's share: ranks in host order, rank 0 on the
    # first host, as the pdsh runner numbers them. What that runner exports to the nodes (PYTHON*, UCX*, MV2*,
    # MLFLOW*, .deepspeed_env) goes over ssh instead.
    Family("deepspeed", "RANK", ("WORLD_SIZE",), "LOCAL_RANK", "LOCAL_SIZE", "CROSS_RANK",
           marker=("CROSS_RANK",), master_addr="MASTER_ADDR", master_port="MASTER_PORT",
           command=Command(("deepspeed",), ("--num_gpus", "{n}", "--master_port", "{port}", "--no_local_rank"),
                           ("--hostfile", "{hostfile}", "--no_ssh", "--node_rank", "{node_rank}", "--master_addr",
                            "{first}", "--master_port", "{port}", "--no_local_rank"), per_host=True, hostfile="slots",
                           exports=("PYTHON", "UCX", "MV2", "MLFLOW"), env_file=("DS_ENV_FILE", ".deepspeed_env"),
                           answers="--help")),
    Family("openmpi", "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), "OMPI_COMM_WORLD_LOCAL_RANK",
           "OMPI_COMM_WORLD_LOCAL_SIZE", mpi_like=True),
    # `mpiexec -n N` is the MPI standard's spelling, so this row also stands for Open MPI's and MVAPICH's;
    # the multi-host form is Hydra's (MPICH, Intel MPI): its ssh launcher, given the ssh found on PATH
    Family("mpich", "PMI_RANK", ("PMI_SIZE",), "MPI_LOCALRANKID", "MPI_LOCALNRANKS", mpi_like=True,
           command=Command(("mpiexec", "mpirun"), ("-n", "{n}", "{python}"),
                           ("-launcher", "ssh", "-launcher-exec", "{ssh}", "-hosts", "{hosts}", "-n", "{n}",
                            "{python}"))),
    Family("mvapich", "MV2_COMM_WORLD_RANK", ("MV2_COMM_WORLD_SIZE",), "MV2_COMM_WORLD_LOCAL_RANK",
           "MV2_COMM_WORLD_LOCAL_SIZE", mpi_like=True),
    # PMIx exports no world size of its own; the launchers that use it (prterun, srun --mpi=pmix) do.
    Family("pmix", "PMIX_RANK", ("OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), mpi_like=True),
    # Inside an sbatch script SLURM_PROCID/SLURM_NTASKS are set too, but only srun steps set SLURM_STEP_ID.
    # This row matches only a step started without PMI (srun --mpi=pmi2 or pmix sets PMI_RANK or PMIX_RANK, the
    # rows above): no MPI world, so the mpi backend cannot start (engines/mpi/manager.py says how to give it one) and
    # torch.distributed meets at MASTER_ADDR:MASTER_PORT, by default the step's first node and slurm_port().
    # SLURM_RESTART_COUNT counts requeues (sbatch --requeue).
    # `unidist launch` inside an allocation starts every backend with srun on the allocation's nodes.
    Family("slurm", "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), "SLURM_LOCALID",
           None, "SLURM_NODEID", marker=("SLURM_STEP_ID",), master_addr="MASTER_ADDR", master_port="MASTER_PORT",
           attempt="SLURM_RESTART_COUNT", mpi_like=True,
           # {mpi}: --mpi=pmi2 for a backend that needs an MPI world (registry: needs_pmi), else --mpi=none, or the
           # user's SLURM_MPI_TYPE (an MPI built for PMIx)
           command=Command(("srun",), ("--ntasks", "{n}", "{mpi}", "{python}"),
                           ("--nodes", "{nnodes}", "--ntasks", "{n}", "--kill-on-bad-exit=1", "{mpi}", "{python}"))),
    # plain env:// variables (torch.distributed.launch, a hand-written script): torch's rendezvous
    Family("env", "RANK", ("WORLD_SIZE",), "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
           master_addr="MASTER_ADDR", master_port="MASTER_PORT"),
)


def family(name: str) -> Family | None:
    """The row named ``name`` (a ``LaunchInfo.launcher``); None for ``"none"`` or an unknown name."""
    return next((fam for fam in LAUNCHERS if fam.name == name), None)


def programs() -> list[str]:
    """Every launcher program unidist knows (the launcher families' commands), and Slurm's srun."""
    names = [prog for fam in LAUNCHERS if fam.command is not None for prog in fam.command.programs]
    return [*dict.fromkeys([*names, "srun"])]


def find_program(name: str) -> str | None:
    """Prefer the program installed beside this Python (the venv's mpiexec matches its mpi4py)."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def _int(environ: Mapping[str, str], name: str, family: str) -> int:
    raw = environ[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise LaunchEnvironmentError(
            f"{name}={raw!r} is not an integer (read as part of the {family} launcher's variables); "
            "fix or unset it"
        ) from None


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in environ), None)


def _slurm_local_size(environ: Mapping[str, str], node: int) -> int | None:
    """Tasks on this node from SLURM_STEP_TASKS_PER_NODE/SLURM_TASKS_PER_NODE, e.g. ``2(x3),1``."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    try:
        counts = tasks_per_node(spec)
    except HostsError as e:  # here it is the launcher's variable, not a host list the user wrote
        raise LaunchEnvironmentError(str(e)) from None
    return counts[node] if node < len(counts) else None


def _slurm_task(environ: Mapping[str, str], rank: int, size: int) -> tuple[int, int, int] | None:
    """(local rank, local size, node rank) of this task from its Slurm job step (SLURM_LOCALID, SLURM_NODEID and
    the step's tasks per node), when the rank and size a PMI gave are the step's own: ``srun --mpi=pmi2`` (or
    pmix) sets PMI_RANK/PMI_SIZE (PMIX_RANK) but no node-local numbering. None outside such a step."""
    if not all(name in environ for name in ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")):
        return None
    tasks = _first(environ, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"))
    if tasks is None or _int(environ, "SLURM_PROCID", "slurm") != rank or _int(environ, tasks, "slurm") != size:
        return None  # a process the step started that numbers its own world (Hydra's proxies under srun)
    node = _int(environ, "SLURM_NODEID", "slurm")
    local_size = _slurm_local_size(environ, node)
    if local_size is None:
        return None
    return _int(environ, "SLURM_LOCALID", "slurm"), local_size, node


def slurm_first_host(nodelist: str) -> str:
    """First host of a SLURM hostlist such as ``gpu[003-005,9],cpu1`` (rank 0 runs there)."""
    try:
        return expand_nodelist(nodelist)[0]
    except HostsError as e:
        raise LaunchEnvironmentError(str(e)) from None


# Rank 0's port under Slurm when MASTER_PORT is unset, from the job and step ids (as Lightning's SLURMEnvironment
# derives one from the job id): every task of a step computes it without talking; two steps of one job (up to
# SLURM_STEPS_APART at once) and jobs whose ids differ by less than SLURM_PORT_SPAN / SLURM_STEPS_APART get
# different ports; all below Linux's ephemeral range (32768), where outgoing connections take theirs.
SLURM_PORT_BASE, SLURM_PORT_SPAN, SLURM_STEPS_APART = 15000, 17000, 16


def slurm_port(environ: Mapping[str, str]) -> int | None:
    """The rendezvous port a Slurm job step derives from SLURM_JOB_ID and SLURM_STEP_ID; None outside a step."""
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    if not (job and step and job.isdigit() and step.isdigit()):
        return None
    slot = int(job) * SLURM_STEPS_APART + int(step) % SLURM_STEPS_APART
    return SLURM_PORT_BASE + slot % SLURM_PORT_SPAN


def slurm_step_hosts(environ: Mapping[str, str]) -> list[tuple[str, int]]:
    """The step's nodes in node-id order with their task counts (SLURM_STEP_NODELIST and
    SLURM_STEP_TASKS_PER_NODE, else the job's): what an engine's own rendezvous needs to know of the layout."""
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not spec:
        raise LaunchEnvironmentError("this Slurm step has no SLURM_STEP_NODELIST or SLURM_STEP_TASKS_PER_NODE: "
                                     "start the job with srun")
    try:
        nodes, counts = expand_nodelist(nodelist), tasks_per_node(spec)
    except HostsError as e:  # the launcher's variables, not a host list the user wrote
        raise LaunchEnvironmentError(str(e)) from None
    if len(counts) < len(nodes):
        raise LaunchEnvironmentError(f"{nodelist!r} names {len(nodes)} nodes but the tasks per node {spec!r} "
                                     f"cover {len(counts)}")
    return list(zip(nodes, counts[:len(nodes)], strict=True))


def _from_family(environ: Mapping[str, str], fam: Family) -> LaunchInfo:
    size_var = _first(environ, fam.size)
    if size_var is None:
        raise LaunchEnvironmentError(
            f"{fam.rank}={environ[fam.rank]!r} is set but none of {', '.join(fam.size)} is: the {fam.name} "
            "launcher gives a rank together with a world size. Launch with the launcher, or set both."
        )
    rank, size = _int(environ, fam.rank, fam.name), _int(environ, size_var, fam.name)
    seen = f"{fam.rank}={rank}, {size_var}={size}"
    if size < 1 or not 0 <= rank < size:
        raise LaunchEnvironmentError(f"inconsistent launch variables: {seen}; need 0 <= rank < size")

    # srun --mpi=pmi2/pmix: the PMI numbers the world only; the step says where each task runs
    step = None if fam.name == "slurm" or (fam.local_rank and fam.local_rank in environ) else \
        _slurm_task(environ, rank, size)
    if fam.local_rank and fam.local_rank in environ:
        local_rank = _int(environ, fam.local_rank, fam.name)
        seen += f", {fam.local_rank}={local_rank}"
    elif step is not None:
        local_rank = step[0]
        seen += f", SLURM_LOCALID={local_rank}"
    else:  # no node-local numbering: assume one node
        local_rank = rank
    node_rank = _int(environ, fam.node_rank, fam.name) if fam.node_rank and fam.node_rank in environ else None
    if fam.local_size and fam.local_size in environ:
        local_size = _int(environ, fam.local_size, fam.name)
        seen += f", {fam.local_size}={local_size}"
    elif step is not None:
        local_size, node_rank = step[1], step[2]
        seen += f", SLURM_STEP_TASKS_PER_NODE={local_size} on node {node_rank}"
    elif fam.name == "slurm":
        local_size = _slurm_local_size(environ, node_rank or 0) or size
    else:
        local_size = size if local_rank == rank else local_rank + 1
    if local_size < 1 or not 0 <= local_rank < local_size or local_size > size:
        raise LaunchEnvironmentError(
            f"inconsistent launch variables: {seen}; need 0 <= local rank < local size <= size"
        )
    if node_rank is None:  # block placement, the default of every launcher listed
        node_rank = rank // local_size

    master_addr = environ.get(fam.master_addr) if fam.master_addr else None
    if fam.name == "slurm" and master_addr is None:
        nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        master_addr = slurm_first_host(nodelist) if nodelist else None
    master_port = None
    if fam.master_port and fam.master_port in environ:
        master_port = _int(environ, fam.master_port, fam.name)
        if not 0 < master_port < 65536:
            raise LaunchEnvironmentError(f"{fam.master_port}={master_port} is not a TCP port (1-65535)")
    if fam.name == "slurm" and master_port is None:
        master_port = slurm_port(environ)
    attempt = _int(environ, fam.attempt, fam.name) if fam.attempt and fam.attempt in environ else 0
    return LaunchInfo(rank, size, local_rank, local_size, node_rank, master_addr or None, master_port, fam.name,
                      attempt)


def detect(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's variables from ``environ`` (default ``os.environ``); no launcher -> a world of one."""
    env = os.environ if environ is None else environ
    for fam in LAUNCHERS:
        if fam.rank in env and all(m in env for m in fam.marker):
            return _from_family(env, fam)
    orphans = [name for fam in LAUNCHERS for name in fam.size[:1] if name in env]
    if orphans:
        raise LaunchEnvironmentError(
            f"{', '.join(sorted(set(orphans)))} set without the matching rank variable; a world size needs a "
            "rank. Launch with the launcher, or unset it to run as one process."
        )
    return LaunchInfo()


def script_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> list[str]:
    """The script's own arguments: ``argv[1:]`` (default ``sys.argv``) without the ``--local_rank=N`` that the
    deepspeed launcher (and torch.distributed.launch) append, for ``parser.parse_args(unidist.script_args())``.

    Nothing is edited in place: importing unidist never touches ``sys.argv``, so a script that declares
    ``--local_rank`` itself (as DeepSpeed's examples do) still sees it. Only an argument whose N equals
    LOCAL_RANK is dropped, so a user's own flag with another value survives; the value stays available as
    ``mgr.local_rank``. ``deepspeed --no_local_rank`` (what ``unidist launch`` passes) appends nothing.
    """
    args = list((sys.argv if argv is None else argv)[1:])
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_RANK")
    if local is None:
        return args
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in (f"--local_rank={local}", f"--local-rank={local}"):
            i += 1
        elif a in ("--local_rank", "--local-rank") and i + 1 < len(args) and args[i + 1] == local:
            i += 2
        else:
            out.append(a)
            i += 1
    return out
