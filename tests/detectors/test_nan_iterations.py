"""Megatron's ``number of nan iterations: N`` is evidence for a NaN incident, not a NaN value:
beside a non-finite loss or grad norm of the same report it adds no page; alone (Megatron
skipped the NaN iterations, so the printed loss is finite) it is the one sign and pages once.
Through ``replay``: the parser, the shipped rules and the alert book, as the daemon runs them."""

from pathlib import Path

from conftest import CORPUS
from precision_agent.commands.replay import replay
from precision_agent.engine.rulefile import default_rules_dir, load_rules

RULES = load_rules([default_rules_dir()])


def line(it: int, loss: str = "2.500000E+00", gnorm: str = "1.2", skipped: int = 0, nans: int = 0) -> str:
    return (f" iteration {it:>8}/    1000 | consumed samples: {it * 8:>12} | learning rate: 1.000000E-04 | "
            f"global batch size:     8 | lm loss: {loss} | loss scale: 1.0 | grad norm: {gnorm} | "
            f"number of skipped iterations: {skipped:>3} | number of nan iterations: {nans:>3} |")


def nonfinite(tmp_path: Path, lines: list[str]) -> list[tuple[str, int | None]]:
    path = tmp_path / "train.log"
    path.write_text("\n".join(lines) + "\n")
    return findings(replay(path, RULES))


def findings(r: dict) -> list[tuple[str, int | None]]:
    """(metric, line) of each TrainingNonFinite finding ("NaN/Inf in METRIC at step N")."""
    return [(f["summary"].split(" in ", 1)[1].split(" ")[0], f["line"]) for f in r["findings"]
            if f["rule"] == "TrainingNonFinite"]


def test_counter_beside_a_nan_loss_and_grad_norm_adds_no_page(tmp_path):
    found = nonfinite(tmp_path, [line(i) for i in range(1, 10)] + [line(10, "nan", "nan", skipped=0, nans=1)])
    assert sorted(found) == [("grad_norm", 10), ("loss", 10)]


def test_counter_alone_pages_once_for_the_incident(tmp_path):
    lines = [line(i) for i in range(1, 10)] + [line(i, skipped=1, nans=1) for i in range(10, 15)]
    found = nonfinite(tmp_path, lines)
    # one alert (the book keys it by rule and series + metric): the later reports are its evidence
    assert {m for m, _ in found} == {"nan_iterations"} and found[0] == ("nan_iterations", 10)


def test_zero_counter_is_no_evidence(tmp_path):
    assert nonfinite(tmp_path, [line(i) for i in range(1, 30)]) == []


def test_corpus_megatron_logs_page_no_counter_of_their_own():
    logs = sorted((CORPUS / "logs").glob("megatron_*.log")) + sorted((CORPUS / "logs" / "healthy").glob("*.log"))
    if not logs:
        import pytest
        pytest.skip("shared corpus not available")
    for path in logs:
        metrics = set(findings(replay(path, RULES)))
        counters = {ln for m, ln in metrics if m == "nan_iterations"}
        shown = {ln for m, ln in metrics if m in ("loss", "grad_norm")}
        assert not counters & shown, path  # never a second page for a report that already paged
