"""The alpha-beta-gamma cost model of collectives: formulas, the algorithm each engine runs, and the fit.

Hockney's model as Thakur, Rabenseifner and Gropp use it ("Optimization of Collective Communication
Operations in MPICH", IJHPCA 2005): a message of ``m`` bytes between two ranks costs ``alpha + m beta``,
reducing ``m`` bytes locally costs ``m gamma``. An algorithm's time on ``p`` ranks is then
``a alpha + b beta + c gamma`` with coefficients (a, b, c) that depend only on ``p`` and the size ``n``
(nccl-tests' bytes, as ``collectives`` reports them): that linearity is what lets ``fit`` find the parameters
by least squares. Non-powers of two use MPICH's fix-ups (fold the extra ranks into their neighbours first).

What is fitted, and why per collective: on one machine a "link" is a memory copy, and each collective has
its own software path and copy pattern (raw mpi4py on 2 ranks, 8 B: allreduce 1.9 us, alltoall 3.7 us; per
byte, MPICH's allgather copies about twice what its broadcast does). One (alpha, beta) per engine missed many
2-rank cells by 40-70%, so each collective gets its own ``Link``: alpha and beta for messages up to a split
size and another pair above (a protocol switch or the cache: the cost per byte of a 2-rank mpi4py allreduce
roughly doubles from 4 to 16 MiB, 117 to 211 ps/B). The rank count enters only through the formulas, so a fit
on 2 ranks that predicts 3 and 4 tests the formulas. gamma (seconds per byte reduced) is not fitted: see
``fit_link``; it is a measured local add (``model_measure.local_gamma``).

Nothing here imports torch or numpy: the fit is a small non-negative least-squares solve in plain Python. Which
library's algorithms an engine runs is its registration record's to say (``engine_kind``), not a table here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from unidist import registry
from unidist.errors import ConfigError, InvalidArgumentError

__all__ = ["ALGORITHMS", "KNOWN", "MIN_SPLIT", "Coeffs", "Link", "Params", "choose", "coefficients",
           "engine_kind", "fit", "fit_link", "nnls", "predict"]

Coeffs = tuple[float, float, float]  # (a, b, c): time = a alpha + b beta + c gamma


def _lg(p: int) -> int:
    return max(0, math.ceil(math.log2(p)))


def _pof2(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def ring_allreduce(p: int, n: float) -> Coeffs:
    """Reduce-scatter then allgather around a ring: 2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma."""
    return 2 * (p - 1), 2 * (p - 1) / p * n, (p - 1) / p * n


def recursive_doubling_allreduce(p: int, n: float) -> Coeffs:
    """Exchange whole buffers with partners 1, 2, 4, ...: log2 p (alpha + n beta + n gamma) for a power of
    two; otherwise the extra ranks first fold into their neighbours and get the result back at the end
    (MPICH): two more steps, one of them with a reduction."""
    q, extra = _pof2(p), 0 if p == _pof2(p) else 1
    steps = _lg(q)
    return steps + 2 * extra, (steps + 2 * extra) * n, (steps + extra) * n


def rabenseifner_allreduce(p: int, n: float) -> Coeffs:
    """Reduce-scatter by recursive halving, allgather by recursive doubling: 2 log2 p alpha + 2(p-1)/p n beta
    + (p-1)/p n gamma on a power of two (on the largest power of two q <= p after MPICH's fold-in)."""
    q, extra = _pof2(p), 0 if p == _pof2(p) else 1
    return 2 * _lg(q) + 2 * extra, 2 * (q - 1) / q * n + 2 * extra * n, (q - 1) / q * n + extra * n


def ring_allgather(p: int, n: float) -> Coeffs:
    """p-1 steps of n/p bytes (n: the whole gathered output): (p-1) alpha + (p-1)/p n beta."""
    return p - 1, (p - 1) / p * n, 0.0


def recursive_doubling_allgather(p: int, n: float) -> Coeffs:
    """log2 p steps, doubling the block: log2 p alpha + (p-1)/p n beta (Bruck's algorithm costs the same for
    any p, which is what MPICH uses for non-powers of two)."""
    return _lg(p), (p - 1) / p * n, 0.0


def binomial_broadcast(p: int, n: float) -> Coeffs:
    """Binomial tree: ceil(log2 p) (alpha + n beta)."""
    return _lg(p), _lg(p) * n, 0.0


def scatter_allgather_broadcast(p: int, n: float) -> Coeffs:
    """van de Geijn: binomial scatter then ring allgather: (log2 p + p - 1) alpha + 2(p-1)/p n beta."""
    return _lg(p) + p - 1, 2 * (p - 1) / p * n, 0.0


def ring_reduce_scatter(p: int, n: float) -> Coeffs:
    """Ring or pairwise exchange (n: the whole input): (p-1) alpha + (p-1)/p n (beta + gamma)."""
    return p - 1, (p - 1) / p * n, (p - 1) / p * n


def halving_reduce_scatter(p: int, n: float) -> Coeffs:
    """Recursive halving: log2 p alpha + (p-1)/p n (beta + gamma) on a power of two; MPICH folds the extra
    ranks in first (one more step of the whole buffer, with a reduction)."""
    q, extra = _pof2(p), 0 if p == _pof2(p) else 1
    return _lg(q) + extra, (q - 1) / q * n + extra * n, (q - 1) / q * n + extra * n


def pairwise_alltoall(p: int, n: float) -> Coeffs:
    """p-1 exchanges of n/p bytes (n: the whole input): (p-1) alpha + (p-1)/p n beta."""
    return p - 1, (p - 1) / p * n, 0.0


def bruck_alltoall(p: int, n: float) -> Coeffs:
    """Bruck: log2 p steps of n/2 bytes each: log2 p alpha + log2 p n/2 beta."""
    return _lg(p), _lg(p) * n / 2, 0.0


Formula = Callable[[int, float], Coeffs]
ALGORITHMS: dict[str, dict[str, Formula]] = {
    "allreduce": {"ring": ring_allreduce, "recursive_doubling": recursive_doubling_allreduce,
                  "rabenseifner": rabenseifner_allreduce},
    "allgather": {"ring": ring_allgather, "recursive_doubling": recursive_doubling_allgather},
    "broadcast": {"binomial": binomial_broadcast, "scatter_allgather": scatter_allgather_broadcast},
    "reduce_scatter": {"ring": ring_reduce_scatter, "recursive_halving": halving_reduce_scatter},
    "alltoall": {"pairwise": pairwise_alltoall, "bruck": bruck_alltoall},
}


def _mpich(op: str, p: int, n: float) -> str | None:
    """MPICH's documented default selection (its CVAR thresholds; Thakur et al. 2005)."""
    if op == "allreduce":
        return "recursive_doubling" if n <= 2048 else "rabenseifner"
    if op == "allgather":  # power of two below 512 KiB in all: recursive doubling; else Bruck below 80 KiB
        small = n < 512 << 10 if p == _pof2(p) else n < 81920
        return "recursive_doubling" if small else "ring"
    if op == "broadcast":  # MPIR_CVAR_BCAST_MIN_PROCS = 8: fewer ranks always use the binomial tree
        return "binomial" if p < 8 or n < 12288 else "scatter_allgather"
    if op == "reduce_scatter":  # commutative ops: recursive halving below 512 KiB, pairwise above
        return "recursive_halving" if n < 512 << 10 else "ring"
    if op == "alltoall":  # Bruck for <= 256 bytes per destination from 8 ranks; else p-1 exchanges
        return "bruck" if n / p <= 256 and p >= 8 else "pairwise"
    return None


def _gloo(op: str, p: int, n: float) -> str | None:
    """gloo (torch.distributed on CPU, DeepSpeed's CPU accelerator, Horovod with --gloo): ring allreduce (its
    default algorithm) and ring allgather, binomial broadcast, pairwise alltoall; reduce_scatter: unknown."""
    return {"allreduce": "ring", "allgather": "ring", "broadcast": "binomial", "alltoall": "pairwise"}.get(op)


KNOWN: dict[str, Callable[[str, int, float], str | None]] = {"mpich": _mpich, "gloo": _gloo}


def engine_kind(backend: str, launcher: str) -> str | None:
    """Which library's documented algorithms run under ``backend`` started by launcher family ``launcher``: what its
    registration record says (``unidist.registry.RawEngine.algorithms``: that family's entry, else ``"*"``'s). None
    where the record names none, or no backend of that name is registered here (a JSON file from a plugin that is
    not installed): an engine nobody documented is not modelled as if it were another (``choose`` then takes the
    fastest formula, and ``model`` refuses it under ``--policy known``)."""
    try:
        algorithms = registry.get(backend).raw.algorithms
    except ConfigError:
        return None
    kind = algorithms.get(launcher, algorithms.get("*"))
    if kind is not None and kind not in KNOWN:
        raise InvalidArgumentError(f"the {backend} backend's record names the algorithms of {kind!r}, which the cost "
                                   f"model does not know; use one of {', '.join(KNOWN)}")
    return kind


@dataclass
class Link:
    """One collective's fitted costs: ``alpha`` seconds per message and ``beta`` seconds per byte moved for
    messages up to ``split`` bytes, ``alpha_big`` and ``beta_big`` above (equal when one regime fits best).
    Two regimes because the engines switch protocol (MPICH over UCX: eager copies through shared-memory
    cells for small messages, a rendezvous and one large copy above) and large messages leave the cache."""

    alpha: float = 0.0
    beta: float = 0.0
    beta_big: float = 0.0
    split: float = math.inf
    alpha_big: float = 0.0

    def __post_init__(self) -> None:
        if math.isinf(self.split):
            self.alpha_big, self.beta_big = self.alpha, self.beta

    def alpha_at(self, n: float) -> float:
        return self.alpha if n <= self.split else self.alpha_big

    def beta_at(self, n: float) -> float:
        return self.beta if n <= self.split else self.beta_big


@dataclass
class Params:
    """One engine's costs: a ``Link`` per collective, and ``gamma``/``gamma_mem`` seconds per byte reduced
    (a local add) up to / above ``gamma_cache`` bytes, shared by the reductions."""

    links: dict[str, Link] = field(default_factory=dict)
    gamma: float = 0.0
    gamma_mem: float = 0.0
    gamma_cache: float = math.inf

    def time(self, op: str, coeffs: Coeffs, n: float) -> float:
        """Seconds for ``coeffs`` of an ``n``-byte ``op`` (the bandwidth regime follows ``n``)."""
        a, b, c = coeffs
        link = self.links.get(op)
        if link is None:
            raise InvalidArgumentError(f"no fitted costs for {op}: the measurements had none (fitted: "
                                       f"{', '.join(self.links) or 'nothing'})")
        gamma = self.gamma if n <= self.gamma_cache else self.gamma_mem
        return a * link.alpha_at(n) + b * link.beta_at(n) + c * gamma


def choose(kind: str | None, op: str, p: int, n: float, params: Params | None = None, policy: str = "known"
           ) -> str:
    """The algorithm the model uses: with ``policy="known"`` the one the engine ``kind`` is documented to run
    (``KNOWN``), else (or where unknown, ``kind`` None) the fastest under ``params`` (the first listed when none
    given)."""
    if op not in ALGORITHMS:
        raise InvalidArgumentError(f"no cost formulas for {op!r}; use one of {', '.join(ALGORITHMS)}")
    if policy == "known" and kind is not None and kind in KNOWN:
        name = KNOWN[kind](op, p, n)
        if name is not None:
            return name
    algs = ALGORITHMS[op]
    if params is None:
        return next(iter(algs))
    return min(algs, key=lambda name: params.time(op, algs[name](p, n), n))


def coefficients(op: str, algorithm: str, p: int, n: float, cores: int = 0) -> Coeffs:
    """(a, b, c) of ``algorithm`` for an ``n``-byte ``op`` on ``p`` ranks. ``cores`` > 0 and fewer than
    ``p``: the ranks share that many cores, so the copies and adds of one step, concurrent in the model,
    take p / cores as long (b and c scaled; an approximation: a tree's early steps keep fewer ranks busy)."""
    try:
        a, b, c = ALGORITHMS[op][algorithm](p, n)
    except KeyError:
        raise InvalidArgumentError(f"no formula for {op} {algorithm!r}; known: "
                                   f"{', '.join(f'{o}/{a}' for o in ALGORITHMS for a in ALGORITHMS[o])}") from None
    share = p / cores if 0 < cores < p else 1.0
    return a, b * share, c * share


def predict(params: Params, kind: str | None, op: str, p: int, n: float, policy: str = "known", cores: int = 0
            ) -> tuple[float, str]:
    """Predicted seconds of an ``n``-byte ``op`` on ``p`` ranks (sharing ``cores``, 0: one each), and the
    algorithm it assumed."""
    name = choose(kind, op, p, n, params, policy)
    return params.time(op, coefficients(op, name, p, n, cores), n), name


def _solve(rows: Sequence[Sequence[float]], rhs: Sequence[float], cols: Sequence[int]) -> list[float]:
    """Least squares on the columns ``cols`` (normal equations, Gaussian elimination with pivoting)."""
    k = len(cols)
    m = [[sum(r[i] * r[j] for r in rows) for j in cols] + [sum(r[i] * y for r, y in zip(rows, rhs, strict=True))]
         for i in cols]
    for i in range(k):
        piv = max(range(i, k), key=lambda r: abs(m[r][i]))
        m[i], m[piv] = m[piv], m[i]
        if abs(m[i][i]) < 1e-300:
            continue
        for r in range(k):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [x - f * y for x, y in zip(m[r], m[i], strict=True)]
    return [m[i][k] / m[i][i] if abs(m[i][i]) >= 1e-300 else 0.0 for i in range(k)]


def nnls(rows: Sequence[Sequence[float]], rhs: Sequence[float], iters: int = 200) -> list[float]:
    """Non-negative least squares (Lawson and Hanson's active set): a cost is never negative, and an
    unconstrained fit happily trades a negative gamma for a larger beta. ``rows``: the design matrix
    (one row per measurement), ``rhs``: the measurements; the columns should be of similar scale."""
    width = len(rows[0]) if rows else 0
    x = [0.0] * width
    passive: list[int] = []

    def gradient(x: list[float]) -> list[float]:
        res = [y - sum(r[j] * x[j] for j in range(width)) for r, y in zip(rows, rhs, strict=True)]
        return [sum(r[j] * e for r, e in zip(rows, res, strict=True)) for j in range(width)]

    for _ in range(iters):
        w = gradient(x)
        free = [j for j in range(width) if j not in passive and w[j] > 1e-12]
        if not free:
            break
        passive.append(max(free, key=lambda j: w[j]))
        while True:
            z = [0.0] * width
            for j, v in zip(passive, _solve(rows, rhs, passive), strict=True):
                z[j] = v
            if all(z[j] > 0 for j in passive):
                x = z
                break
            step = min(x[j] / (x[j] - z[j]) for j in passive if z[j] <= 0)
            x = [xj + step * (zj - xj) for xj, zj in zip(x, z, strict=True)]
            passive = [j for j in passive if x[j] > 1e-15]
    return x


Sample = tuple[str, int, float, float]  # (op, ranks, bytes, measured seconds)
MIN_SPLIT = 4 << 10  # protocol switches (eager to rendezvous) are KiB; caches (L2: 2 MiB per core) MiB


def fit_link(samples: Sequence[Sample], kind: str | None, gamma: Params, *, caches: Sequence[float] = (),
             policy: str = "known", cores: int = 0) -> Link:
    """Fit one collective's ``Link`` by non-negative least squares on relative error (each row divided by
    its measured time, so 8 B and 16 MiB count alike, as a 25% target wants), with the reduction cost
    known: ``gamma`` (a ``Params`` whose gamma fields are set) is subtracted first. Why not fit gamma too:
    on p ranks every reduction algorithm's beta and gamma coefficients are nearly proportional, so the
    measurements cannot tell them apart; a local add measures it directly.

    ``samples``: (op, ranks, bytes, seconds), one op; ``kind``: the engine's algorithms (``engine_kind``);
    ``caches``: candidate sizes for the two-regime split, a protocol switch or the cache (the least residual
    wins; one regime, infinity, is always tried); ``policy``: "known" or "min" (see ``choose``; while
    fitting, "min" and unknown selections use the first listed algorithm, since there are no parameters
    yet); ``cores``: see ``coefficients``."""
    if not samples:
        raise InvalidArgumentError("no measurements to fit: give collectives JSON files with rows at 2 or more ranks")
    best: tuple[float, Link] = (math.inf, Link())
    for cache in sorted({math.inf, *caches}):
        rows, rhs, terms = [], [], []
        for op, p, n, seconds in samples:
            a, b, c = coefficients(op, choose(kind, op, p, n, None, policy), p, n, cores)
            known = c * (gamma.gamma if n <= gamma.gamma_cache else gamma.gamma_mem)
            small = n <= cache
            rows.append([v / seconds for v in ((a, b, 0.0, 0.0) if small else (0.0, 0.0, a, b))])
            rhs.append(1.0 - known / seconds)
            terms.append((a, b, known, n, seconds))
        scale = [max((abs(r[j]) for r in rows), default=0.0) or 1.0 for j in range(4)]
        x = nnls([[v / s for v, s in zip(r, scale, strict=True)] for r in rows], rhs)
        alpha, beta, alpha_big, beta_big = (v / s for v, s in zip(x, scale, strict=True))
        link = Link(alpha, beta, beta_big, cache, alpha_big)
        resid = sum(((a * link.alpha_at(n) + b * link.beta_at(n) + known) / s - 1) ** 2
                    for a, b, known, n, s in terms)
        if resid < best[0] - 1e-12:
            best = (resid, link)
    return best[1]


def fit(samples: Sequence[Sample], kind: str | None, gamma: Params, *, policy: str = "known", cores: int = 0) -> Params:
    """``fit_link`` for every collective in ``samples``; the result carries ``gamma``'s reduction costs.
    Candidate splits: the measured sizes from ``MIN_SPLIT`` up that leave two sizes on each side (fewer
    would let one noisy point set a regime). Arguments as ``fit_link``."""
    params = Params(gamma=gamma.gamma, gamma_mem=gamma.gamma_mem, gamma_cache=gamma.gamma_cache)
    for op in sorted({s[0] for s in samples}):
        mine = [s for s in samples if s[0] == op]
        sizes = sorted({s[2] for s in mine})
        # two sizes at least on each side: each regime's alpha and beta need two points
        caches = [n for n in sizes[1:-2] if n >= MIN_SPLIT]
        params.links[op] = fit_link(mine, kind, gamma, caches=caches, policy=policy, cores=cores)
    return params
