"""Expected requests in service per priority band and the places to keep free for the
urgent bands (:class:`BandDemand`); the rules and their sources are in
``docs/adaptive-admission.md``, "The decision" ("Room for the urgent bands",
"Time on an engine", "Arrival rates that tell a surge from noise").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from limits.drain_rate import DrainRate
from limits.interfaces import Clock

#: Standard deviations of Poisson noise by which the fast arrival-rate estimate must
#: exceed the slow one to count as a surge (:meth:`BandDemand.rates`): a steady load
#: reads as one about one time in forty.
SURGE_Z = 2.0

#: Probability, at most, that a request of an urgent band waits for a place past its
#: slack (:meth:`BandDemand.urgent_free`): one in a hundred.
URGENT_MISS = 0.01


class BandDemand:
    """Expected requests in service per priority band, from Little's law
    (``L = λ × S``; Little, Operations Research 1961): ``λ`` an EWMA arrival rate
    (:class:`~limits.drain_rate.DrainRate`) and ``S`` the time a request of the band
    holds an engine (:meth:`service_s`); and the places to keep free for the urgent
    bands (:meth:`urgent_free`).

    ``S`` is the time on an engine predicted when each request is sent (TTFT̂ +
    TPOT̂ × its output cap, :attr:`~limits.engine_latency.Flight.expected_s`), an EWMA
    over the band's sends, times an EWMA over its finished requests of their actual
    time over that prediction (docs/adaptive-admission.md, "Time on an engine").

    Args:
        clock: monotonic time, s.
        bands: band names, most urgent first.
        tau_s: time constant of the arrival rates, s (default 10).
        fast_tau_s: time constant of a second, faster estimate of each rate, s
            (default 2.5); while it reads a surge (:meth:`rates`), :meth:`urgent_free`
            and :meth:`occupancy_through` take the larger of the two, so the places
            for an urgent band open within seconds of its surge.
        alpha: EWMA weight of a new predicted time on an engine, ratio of actual to
            predicted time, or TTFT (default 0.1).
    """

    def __init__(self, clock: Clock, bands: Sequence[str], *, tau_s: float = 10.0,
                 fast_tau_s: float = 2.5, alpha: float = 0.1) -> None:
        self.clock = clock
        self.bands = list(bands)
        self._tau_s, self._fast_tau_s = tau_s, fast_tau_s
        self._rate = {b: DrainRate(tau_s) for b in self.bands}
        self._fast = {b: DrainRate(fast_tau_s) for b in self.bands}
        self._expected = dict.fromkeys(self.bands, 0.0)  # predicted time on an engine, s
        self._ratio = dict.fromkeys(self.bands, 0.0)  # actual / predicted time
        self._ttft = dict.fromkeys(self.bands, 0.0)
        self._alpha = alpha

    def arrived(self, band: str) -> None:
        """A request of ``band`` arrived (whatever becomes of it)."""
        now = self.clock.now()
        self._rate[band].add(now)
        self._fast[band].add(now)

    def _ewma(self, table: dict[str, float], band: str, value: float) -> None:
        old = table[band]
        table[band] = value if old == 0 else old + self._alpha * (value - old)

    def started(self, band: str, expected_s: float) -> None:
        """A request of ``band`` was sent to an engine, predicted to hold it for
        ``expected_s`` (s; 0: no prediction, ignored)."""
        if expected_s > 0:
            self._ewma(self._expected, band, expected_s)

    def served(self, band: str, seconds: float, ttft_s: float | None = None,
               expected_s: float = 0.0) -> None:
        """A request of ``band`` held an engine for ``seconds``, predicted at send
        to hold it ``expected_s`` (s; 0: no prediction); ``ttft_s``: the time from its
        send to its first token there (None: it had none)."""
        if expected_s > 0 and seconds > 0:
            self._ewma(self._ratio, band, seconds / expected_s)
        if ttft_s is not None:
            self._ewma(self._ttft, band, ttft_s)

    def service_s(self, band: str) -> float:
        """``S`` of ``band``: the mean time a request of it holds an engine, s (class
        docstring); 0 before one of its requests with a prediction has finished."""
        return self._expected[band] * self._ratio[band]

    def rate(self, band: str) -> float:
        """Arrivals of ``band`` per second."""
        return self._rate[band].rate(self.clock.now())

    def occupancy(self, band: str) -> float:
        """``λ × S`` of ``band``: requests of it in service on average."""
        return self._rate[band].rate(self.clock.now()) * self.service_s(band)

    def total_occupancy(self) -> float:
        """Summed occupancy of every band: requests in service on average."""
        return sum(self.occupancy(b) for b in self.bands)

    def rates(self, bands: Sequence[str]) -> dict[str, float]:
        """Arrival rates of ``bands``, per second: the slow estimates, or each band's
        larger of its slow and fast estimates while the bands together surge.

        A surge is the fast estimate of the summed rate above the slow one by more
        than :data:`SURGE_Z` standard deviations of their difference under a steady
        Poisson rate ``λ`` (the slow sum): the two exponential-kernel estimators
        (time constants ``τf``, ``τs``) of one Poisson process differ with variance
        ``λ (1/(2τf) + 1/(2τs) − 2/(τf + τs))`` (Campbell's theorem applied to the
        difference of their kernels). Below that the fast estimate is Poisson noise,
        about ±30 % at 1 request/s: taking the larger of two noisy estimates would
        read every chance cluster of arrivals as a surge and hold back capacity that
        the long-run load leaves free. A doubling of the load shows within about
        two seconds at the default time constants. A surge also restarts each band's
        slow estimate at that larger one (:meth:`DrainRate.restart`: an average
        restarted at a detected change), so the long-run reading stays at the new
        level when the fast one next dips, rather than taking ``τs`` to get there:
        the burst rule of :func:`limits.decision.decide` trusts it, and a lagging reading let the
        fleet fill past its knees in the seconds after a surge's first cluster."""
        now = self.clock.now()
        slow = {b: self._rate[b].rate(now) for b in bands}
        fast = {b: self._fast[b].rate(now) for b in bands}
        lam = sum(slow.values())
        tf, ts = self._fast_tau_s, self._tau_s
        spread = math.sqrt(max(0.0, lam * (1 / (2 * tf) + 1 / (2 * ts) - 2 / (tf + ts))))
        if sum(fast.values()) - lam <= SURGE_Z * spread:
            return slow
        rates = {b: max(slow[b], fast[b]) for b in bands}
        for b, rate in rates.items():
            self._rate[b].restart(rate, now)
        return rates

    def occupancy_through(self, band: str) -> float:
        """Summed occupancy of ``band`` and the bands more urgent, at their
        :meth:`rates` (a surge reads within seconds): what will hold the engines in
        the long run when the less urgent bands yield to them (:meth:`urgent_free`)."""
        rates = self.rates(self.bands[:self.bands.index(band) + 1])
        return sum(r * self.service_s(b) for b, r in rates.items())

    def urgent_free(self, band: str, places: float, ttft_targets: dict[str, float],
                    miss: float = URGENT_MISS) -> int:
        """Places to keep free, fleet-wide, for the bands more urgent than ``band``
        so that an urgent request waits for one past its slack with probability at
        most ``miss``.

        While requests of ``band`` fill every other place, the urgent requests (rate
        ``λ``, their :meth:`rates` summed: a surge reads within seconds) take the
        ``k`` kept free, and departures (rate ``μ = places / S̄``, ``S̄ = L / Λ`` the
        mean time on an engine over all bands) give them back. The
        places used and the urgent requests waiting then form the birth–death chain
        of an M/M/1 queue started ``k`` deep, so an urgent request waits longer than
        ``s`` with probability ``r^k e^{−(μ−λ)s}``, ``r = λ / μ`` (the M/M/1
        waiting-time tail, Kleinrock, Queueing Systems vol. 1, 1975, §3.2, shifted by
        ``k``). ``k`` is the smallest with that at most ``miss``; ``s`` the smallest
        slack of the urgent bands, their TTFT target (``ttft_targets``, s) less
        their mean TTFT on an engine.

        Returns 0 for the most urgent band or before any urgent arrival or finished
        request, ``ceil(places)`` when the urgent bands alone would fill them
        (``r ≥ 1``).
        """
        urgent = self.bands[:self.bands.index(band)]
        now = self.clock.now()
        lam = sum(self.rates(urgent).values())
        total = sum(self._rate[b].rate(now) for b in self.bands)
        occupancy = self.total_occupancy()
        if lam <= 0 or occupancy <= 0 or places <= 0:
            return 0
        mu = places * total / occupancy
        r = lam / mu
        if r >= 1:
            return math.ceil(places)
        slack = min(max(0.0, ttft_targets[b] - self._ttft[b]) for b in urgent)
        k = (math.log(miss) + (mu - lam) * slack) / math.log(r)
        return min(math.ceil(places), max(0, math.ceil(k)))
