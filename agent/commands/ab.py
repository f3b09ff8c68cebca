"""``precision-agent fusion ab ON.log OFF.log``: the ``ab`` rule kind's verdict on two finished logs.

Each log goes through the same reader, parsers and series state as the daemon (one series per
file: ranks folded, as the loss curves of one run agree across ranks); the curves are then judged
by ``detectors.ab.judge``, the function the daemon's ``FusionSuspected`` rule uses.
"""

from __future__ import annotations

from pathlib import Path

from ..detectors.ab import AbParams, AbResult, curve, judge, new_side, take
from ..model import HINT_METRICS
from ..readers.logstream import LogStream
from ..series.state import SeriesState

READ_STEP = 4 << 20
SHIPPED_RULE = ("fusion.yml", "FusionSuspected")   # the live rule whose parameters the CLI uses


def shipped_params(**overrides: object) -> AbParams:
    """The parameters of the shipped live rule (rules/fusion.yml, FusionSuspected, kind ``ab``), so
    that ``fusion ab`` and ``bisect --from-ab`` judge two logs as the daemon judges them live;
    ``overrides`` (not None) replace some (validated again). ConfigError when the shipped rule
    file is broken."""
    from ..engine.rulefile import default_rules_dir, load_rule_file
    name, alert = SHIPPED_RULE
    rules = [r for r in load_rule_file(default_rules_dir() / name) if r.name == alert and r.spec.kind == "ab"]
    base = rules[0].detector.params.model_dump() if rules else {}
    return AbParams.model_validate({**base, **{k: v for k, v in overrides.items() if v is not None}})


def side_of(path: Path, params: AbParams, fmt: str = "auto") -> dict:
    """One run's curve: losses by step, its first break, its highest step."""
    side = new_side()
    series = SeriesState(())
    stream = LogStream(str(path), {}, fmt, None)
    try:
        while True:
            before = stream.stats.bytes
            _feed(stream.poll(READ_STEP), series, side, params)
            if stream.stats.bytes == before:
                break
        _feed(stream.finish(), series, side, params)
    finally:
        stream.close()
    return side


def _feed(samples: list, series: SeriesState, side: dict, params: AbParams) -> None:
    for s in samples:
        if s.metric in HINT_METRICS:
            series.apply_hint(s)
            continue
        s.labels = ()  # one run: the ranks' copies of a record fold into one curve
        for accepted in series.ingest(s):
            take(accepted, series, side, params.max_points)


def compare_logs(on: Path, off: Path, params: AbParams | None = None, fmt: str = "auto") -> AbResult:
    params = params or shipped_params()
    return judge(curve(side_of(on, params, fmt)), curve(side_of(off, params, fmt)), params)


# what a bisection round's run was, from its ab verdict against the fusion-off run
ROUND_RESULT = {"fusion_suspected": "bad", "no_difference": "good", "fusion_off_worse": "good"}


def round_result(round_log: Path, off_log: Path, params: AbParams | None = None, fmt: str = "auto",
                 ) -> tuple[str | None, AbResult]:
    """``fusion bisect --from-ab``: the run made with a round's switch file against the run with all
    fusion off. Clearly worse (``fusion_suspected``): ``bad``, the culprit is still on; no
    difference (or better): ``good``; too few common steps: None, no answer yet."""
    r = compare_logs(round_log, off_log, params, fmt)
    return ROUND_RESULT.get(r.verdict), r
