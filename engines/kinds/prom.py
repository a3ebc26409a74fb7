"""Prometheus text exposition → sample values, for the dialect parsers."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families


def prometheus_samples(text: str, names: Iterable[str]) -> dict[str, list[float]]:
    """Values of the wanted metrics, by name, one per label set (summed by callers).

    A counter's ``_total`` suffix is removed and ``_created`` samples dropped, so
    ``names`` are given without ``_total``. Only sample lines that start with a wanted
    name reach the parser, which keeps large pages (histograms) cheap. Absent metrics
    are absent from the result.

    Raises:
        ValueError: the wanted lines are not valid Prometheus exposition.
    """
    wanted = tuple(names)
    lines = "\n".join(line for line in text.splitlines() if line.startswith(wanted))
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(lines):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = sample.name.removesuffix("_total")
            if name in wanted:
                out.setdefault(name, []).append(float(sample.value))
    return out
