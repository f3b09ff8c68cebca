"""``fusion bisect --from-ab ROUND.log OFF.log`` (issue 11, part 5): each round's result is taken from
the ``ab`` verdict of the log of the run made with that round's switch file against the log of the
run with all fusion off. A simulated training process writes the round's log: with the culprit pass
still on, its loss scale collapses; with it off, it trains as the fusion-off run does."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from support.fusion import cli, report_text

TRAIN = r"""
import json, math, random, sys
switch, culprit, out, seed, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
off = json.load(open(switch))["Switch"] if switch != "-" else {"ALL": "off"}
broken = culprit not in {p for sec in off.values() if isinstance(sec, dict) for p in sec} and "ALL" not in off
rnd = random.Random(seed)
with open(out, "w") as f:
    for it in range(1, steps + 1):
        loss = 6.0 * math.exp(-it / 300) + 2.0 + rnd.gauss(0, 0.02)
        scale = max(1.0, 65536.0 / 2 ** max(0, it - 100)) if broken else 65536.0
        f.write(f" iteration {it:>8}/    1000 | consumed samples: {it * 8:>12} | learning rate: 1.000000E-04 | "
                f"global batch size:     8 | lm loss: {loss:.6E} | loss scale: {scale} | grad norm: 1.2 | "
                f"number of skipped iterations:   0 | number of nan iterations:   0 |\n")
"""


def train(switch: Path | None, culprit: str, out: Path, seed: int, steps: int = 200) -> Path:
    subprocess.run([sys.executable, "-c", TRAIN, str(switch) if switch else "-", culprit, str(out), str(seed),
                    str(steps)], check=True, timeout=60)
    return out


def test_bisection_driven_by_the_ab_verdicts_of_the_rounds(tmp_path):
    n, culprit = 23, "G014FusionPass"
    rep = tmp_path / "fusion_result.json"
    rep.write_text(report_text(n))
    session, cfg = tmp_path / "bisect.json", tmp_path / "fusion_switch.cfg"
    off_log = train(None, culprit, tmp_path / "off.log", seed=1)
    doc = json.loads(cli("bisect", "--passes", rep, "--session", session, "--json").stdout)
    rounds = 0
    while not doc["done"]:
        rounds += 1
        round_log = train(cfg, culprit, tmp_path / f"round{rounds}.log", seed=100 + rounds)
        p = cli("bisect", "--session", session, "--from-ab", round_log, off_log, "--json")
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        healthy = culprit in json.loads((tmp_path / "bisect.json").read_text())["rounds"][rounds - 1]["off"]
        ab = doc["from_ab"]
        assert ab["round_log"] == str(round_log) and ab["result"] == ("good" if healthy else "bad")
        assert ab["verdict"] == ("no_difference" if healthy else "fusion_suspected")
    assert doc["culprit"] == culprit and rounds <= math.ceil(math.log2(n))
    text = cli("bisect", "--session", session).stdout
    assert culprit in text


def test_from_ab_without_enough_steps_records_nothing(tmp_path):
    rep = tmp_path / "fusion_result.json"
    rep.write_text(report_text(4))
    session, cfg = tmp_path / "bisect.json", tmp_path / "fusion_switch.cfg"
    assert cli("bisect", "--passes", rep, "--session", session).returncode == 0
    before = session.read_text()
    off_log = train(None, "G001FusionPass", tmp_path / "off.log", seed=1, steps=10)
    round_log = train(cfg, "G001FusionPass", tmp_path / "r.log", seed=2, steps=10)
    p = cli("bisect", "--session", session, "--from-ab", round_log, off_log)
    assert p.returncode == 2 and "insufficient_data" in p.stderr and "--result" in p.stderr
    assert session.read_text() == before
    p = cli("bisect", "--session", session, "--from-ab", round_log, off_log, "--result", "good")
    assert p.returncode == 2 and "not both" in p.stderr
    p = cli("bisect", "--session", session, "--from-ab", tmp_path / "missing.log", off_log)
    assert p.returncode == 2 and "missing.log" in p.stderr
    assert session.read_text() == before


def test_from_ab_uses_the_shipped_rules_alpha(tmp_path):
    """A round whose loss gap is significant at the live rule's alpha (0.01) but not at 0.001 is bad."""
    def log(path: Path, ratio) -> Path:
        with open(path, "w") as f:
            for it in range(1, 201):
                f.write(f" iteration {it:>8}/    1000 | consumed samples: {it * 8:>12} | learning rate: 1.0E-04 | "
                        f"global batch size:     8 | lm loss: {3.0 * ratio(it):.6E} | loss scale: 65536.0 | "
                        f"grad norm: 1.2 | number of skipped iterations:   0 | number of nan iterations:   0 |\n")
        return path
    rep = tmp_path / "fusion_result.json"
    rep.write_text(report_text(4))
    session = tmp_path / "bisect.json"
    assert cli("bisect", "--passes", rep, "--session", session, "--json").returncode == 0
    round_log = log(tmp_path / "round1.log", lambda it: 1.05 if it % 50 < 34 else 0.99)
    off_log = log(tmp_path / "off.log", lambda it: 1.0)
    p = cli("bisect", "--session", session, "--from-ab", round_log, off_log, "--json")
    assert p.returncode == 0, p.stderr
    ab = json.loads(p.stdout)["from_ab"]
    assert (ab["verdict"], ab["result"], ab["evidence"]["alpha"]) == ("fusion_suspected", "bad", 0.01)
