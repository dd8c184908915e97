"""The text of ``unidist info --check``: the answers in the order a reader checks them (engines, launchers,
machine, network), then one verdict line a backend and what the exit code means."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unidist.doctor.verdict import EXIT_ANOTHER, EXIT_USABLE, mpi_family, mpi_version

__all__ = ["lines"]


def _engine(pkg: str, a: Mapping[str, Any]) -> str:
    if not a.get("ok"):
        return "not installed" if a.get("absent") else f"FAILS: {a.get('error')}"
    text = str(a.get("version") or "?")
    if pkg == "mpi4py":
        lib = a.get("library_version", "")
        text += (f"   {mpi_family(lib) or lib.splitlines()[0] if lib else '?'} {mpi_version(lib) or ''} "
                 f"(MPI {a.get('mpi_standard')}), library {a.get('library') or a.get('module')}; CUDA-aware: "
                 + {True: "yes", False: "no (the mpi backend stages CUDA tensors through host memory)",
                    None: "unknown before MPI starts"}[a.get("cuda_aware")])
    elif pkg == "torch":
        text += f"   distributed backends: {', '.join(a.get('backends', [])) or 'none'}; GPUs: {a.get('gpus')}"
        if a.get("gpu_names"):
            text += f" ({', '.join(a['gpu_names'])})"
        if a.get("cuda"):
            driver = f", driver supports CUDA {a['driver_cuda']}" if a.get("driver_cuda") else ""
            text += f"; built for CUDA {a['cuda']}{driver}"
        if a.get("nccl"):
            text += f"; NCCL {a['nccl']}"
    elif pkg == "horovod":
        text += (f"   frameworks: {', '.join(a.get('frameworks', [])) or 'none'}; controllers: "
                 f"{', '.join(a.get('controllers', [])) or 'none'}; ops: {', '.join(a.get('ops', [])) or 'cpu'}")
    elif pkg == "deepspeed":
        text += f"   accelerator: {a.get('accelerator')} ({a.get('devices')} device(s))"
    return text


def _program(p: Mapping[str, Any]) -> str:
    if not p.get("found"):
        return "not found"
    if not p.get("answered"):
        return f"{p['path']}   FAILS: {p.get('error')}"
    first = p.get("output", "").splitlines()[0][:60]
    version = mpi_version(p.get("output", ""))
    said = f"version {version}" if version else (f"answers {p.get('option')}" + (f": {first}" if p.get("option")
                                                                                   == "--version" else ""))
    runs = f"; runs {p['python']}" if p.get("python") else ""
    return f"{p['path']}   {said}{runs}"


def _devices(plan: Mapping[str, Any], nccl: Mapping[str, str], gpus: int | None) -> list[str]:
    """The device each rank of this host gets, and the NCCL variables in effect (on a GPU host)."""
    if "error" in plan:
        return [f"devices: init() would fail: {plan['error']}"]
    if not plan:
        return []
    devices = plan["devices"]
    text = "devices init() gives this host's ranks: " + ", ".join(
        f"local rank {r} -> {d}" for r, d in enumerate(devices[:8])) + (", ..." if len(devices) > 8 else "")
    out = [text]
    if plan.get("shared"):
        out.append(f"  {len(devices)} ranks share {plan['gpus']} GPU(s): the torch backend moves CUDA tensors through "
                   "host memory (slower than NCCL), the deepspeed backend refuses; start at most "
                   f"{plan['gpus']} rank(s) per host to use NCCL")
    if gpus:
        said = " ".join(f"{k}={v}" for k, v in nccl.items()) if nccl else "none set (NCCL's defaults)"
        out.append(f"NCCL variables: {said}")
    return out


def lines(report: Mapping[str, Any]) -> list[str]:
    """The report of ``unidist.doctor.check`` as text lines."""
    out = [f"unidist info --check ({report['seconds']:.1f} s)   python {report['python']}", "engines (imported):"]
    out += [f"  {pkg:<10} {_engine(pkg, a)}" for pkg, a in report["packages"].items()]
    out.append("launchers:")
    out += [f"  {name:<10} {_program(p)}" for name, p in report["programs"].items()]
    m = report["machine"]
    gpus = "unknown (torch not usable)" if m["gpus"] is None else m["gpus"]
    out.append(f"machine: {m['cpus']} CPUs ({m['usable']} usable by this process), GPUs: {gpus}")
    out += _devices(report.get("devices", {}), report.get("nccl_variables", {}), m["gpus"])
    out.append("network (a several-host job's rank 0 offers the routed interface's address):")
    for i in report["network"]["interfaces"]:
        flags = [w for w, on in (("up", i["up"]), ("loopback", i["loopback"]), ("routed", i["route"])) if on]
        out.append(f"  {i['name']:<10} {i['address'] or 'no IPv4 address':<16} {' '.join(flags) or 'down'}")
    for var, v in report["network"]["variables"].items():
        said = f"{var}={v['value']}" if v["value"] is not None else f"{var} unset (the engine picks)"
        out.append(f"  {said}   [{v['engine']}]" + (f"   NOTE: {v['note']}" if v["note"] else ""))
    out.append("backends:")
    chosen = report["would_run"]
    for name, v in report["backends"].items():
        state = ("usable" if v["usable"] else "NOT usable") + (" (runs here)" if name == chosen else "")
        problems = "".join(f"\n             {p}" for p in v["problems"])
        out.append(f"  {name:<10} {state}{problems}" + "".join(f"\n             note: {n}" for n in v["notes"]))
    code = report["exit_code"]
    if code == EXIT_USABLE:
        out.append(f"verdict: {chosen} works here (exit 0)")
    elif code == EXIT_ANOTHER:
        usable = report["usable_launched"]
        why = f"{chosen} does not work here" if chosen else "no launcher program is installed"
        out.append(f"verdict: {why}; {', '.join(usable)} would (--backend, UNIDIST_BACKEND) (exit {code})")
    else:
        out.append(f"verdict: no multi-process backend works here; install one of the above (exit {code})")
    return out
