"""The ``ab`` kind (issue 11, part 4): a fusion-on run against a fusion-off run on the curves both
have. Verdicts on curve pairs (collapse only with fusion on, noise only, off worse, too few steps),
through ``judge`` and through the real pipeline with the shipped FusionSuspected rule."""

from __future__ import annotations

import json
import math
import random

import pytest

from precision_agent.detectors.ab import AbParams, Curve, judge
from precision_agent.model import LOSS, LOSS_SCALE, Sample, SourcePos
from precision_agent.engine.pipeline import Pipeline
from precision_agent.engine.rulefile import default_rules_dir, load_rules

P = AbParams()


def curve(losses: dict[int, float], bad: tuple[int, str] | None = None) -> Curve:
    return Curve(dict(losses), bad, max(losses) if losses else None)


def base(steps: int, seed: int, noise: float = 0.02) -> dict[int, float]:
    rnd = random.Random(seed)
    return {s: 6.0 * math.exp(-s / 300) + 2.0 + rnd.gauss(0, noise) for s in range(1, steps + 1)}


def test_noise_only_is_no_difference():
    for seed in range(20):
        r = judge(curve(base(200, seed)), curve(base(200, 1000 + seed)), P)
        assert r.verdict == "no_difference", (seed, r)


def test_one_noisy_step_decides_nothing():
    on, off = base(200, 1), base(200, 2)
    on[190] += 5.0  # a single bad batch with fusion on
    assert judge(curve(on), curve(off), P).verdict == "no_difference"


def test_a_loss_gap_beyond_noise_with_fusion_on_is_suspected():
    on, off = base(200, 3), base(200, 4)
    on = {s: v * 1.05 for s, v in on.items()}  # 5 % worse with fusion on
    r = judge(curve(on), curve(off), P)
    assert r.verdict == "fusion_suspected" and r.steps_compared == 100  # both halves of 2 x window
    assert r.evidence["check"] == "loss_gap" and r.evidence["relative_gap"] > 0.02


def test_fusion_off_worse():
    on, off = base(200, 5), base(200, 6)
    off = {s: v * 1.05 for s, v in off.items()}
    assert judge(curve(on), curve(off), P).verdict == "fusion_off_worse"


def test_collapse_only_with_fusion_on_is_suspected_at_once():
    on, off = base(40, 7), base(60, 8)
    r = judge(curve(on, (35, "loss_scale_collapse")), curve(off), P)
    assert r.verdict == "fusion_suspected" and r.evidence["check"] == "loss_scale_collapse"


def test_a_break_the_other_run_had_not_reached_yet_is_no_verdict():
    on, off = base(40, 9), base(20, 10)
    r = judge(curve(on, (35, "nonfinite_loss")), curve(off), P)
    assert r.verdict != "fusion_suspected"  # fusion off has not reached step 35: we cannot say yet


def test_too_few_common_steps():
    assert judge(curve(base(200, 11)), curve(base(10, 12)), P).verdict == "insufficient_data"
    assert judge(curve({}), curve({}), P).verdict == "insufficient_data"


# --- through the real pipeline and the shipped rule ---------------------------------------------------

def feed(p: Pipeline, fusion: str, step: int, metric: str, value: float) -> list:
    labels = (("fusion", fusion), ("job", "llama"))
    return p.process([Sample(labels, metric, value, step, SourcePos(f"{fusion}.log", step), time=1000.0 + step,
                             producer="megatron")])


def shipped() -> Pipeline:
    rs = load_rules([default_rules_dir()])
    return Pipeline(rs, keep_findings=1000)


def test_shipped_rule_fires_on_a_nan_only_with_fusion_on_and_names_the_pair():
    p = shipped()
    for s in range(1, 31):
        feed(p, "off", s, LOSS, 3.0 - s * 0.01)
        feed(p, "on", s, LOSS, 3.0 - s * 0.01 if s < 25 else math.nan)
    fs = [f for f in p.findings if f.rule == "FusionSuspected"]
    assert len(fs) == 1
    assert dict(fs[0].labels) == {"job": "llama", "severity": "ticket"}
    assert fs[0].evidence["check"] == "nonfinite_loss" and fs[0].evidence["suspect_step"] == 25


@pytest.mark.parametrize("after_nan", ["stops", "keeps_printing_nan"])
def test_shipped_rule_fires_when_the_fusion_on_run_is_ahead(after_nan):
    """The common case: the fusion-on run hits NaN at step 25 before the fusion-off run got there;
    the verdict comes when the fusion-off run passes step 25, whether the fusion-on run stopped
    or keeps printing NaN."""
    p = shipped()
    for s in range(1, 21):
        feed(p, "off", s, LOSS, 3.0 - s * 0.01)
    last = 25 if after_nan == "stops" else 40
    for s in range(1, last + 1):
        feed(p, "on", s, LOSS, 3.0 - s * 0.01 if s < 25 else math.nan)
    assert not [f for f in p.findings if f.rule == "FusionSuspected"]  # fusion off has not reached 25
    for s in range(21, 25):
        feed(p, "off", s, LOSS, 3.0 - s * 0.01)
    assert not [f for f in p.findings if f.rule == "FusionSuspected"]
    for s in range(25, 31):
        feed(p, "off", s, LOSS, 3.0 - s * 0.01)
    fs = [f for f in p.findings if f.rule == "FusionSuspected"]
    assert len(fs) == 1, fs
    assert fs[0].step == 25 and dict(fs[0].labels) == {"job": "llama", "severity": "ticket"}
    assert fs[0].evidence["check"] == "nonfinite_loss" and fs[0].evidence["suspect_step"] == 25


def test_shipped_rule_quiet_on_two_equal_runs_and_on_other_labels():
    p = shipped()
    rnd = random.Random(1)
    for s in range(1, 101):
        feed(p, "off", s, LOSS, 3.0 - s * 0.01 + rnd.gauss(0, 0.01))
        feed(p, "on", s, LOSS, 3.0 - s * 0.01 + rnd.gauss(0, 0.01))
        feed(p, "maybe", s, LOSS, 9.0)  # neither side of the pair
    assert not [f for f in p.findings if f.rule == "FusionSuspected"]


def test_shipped_rule_fires_on_a_collapse_only_with_fusion_on():
    p = shipped()
    scale = 65536.0
    for s in range(1, 31):
        feed(p, "off", s, LOSS_SCALE, 65536.0)
        feed(p, "off", s, LOSS, 3.0)
        if s > 10:
            scale = max(1.0, scale / 4)
        feed(p, "on", s, LOSS_SCALE, scale)
        feed(p, "on", s, LOSS, 3.0)
    (f,) = [f for f in p.findings if f.rule == "FusionSuspected"]
    assert f.evidence["check"] == "loss_scale_collapse"


@pytest.mark.parametrize("bad", [{"window": 2}, {"alpha": 0.7}, {"typo": 1}])
def test_bad_params_are_named(tmp_path, bad):
    import yaml
    from precision_agent.engine.rulefile import load_rule_file
    from precision_agent.config import ConfigError
    rule = {"alert": "A", "kind": "ab", "params": bad, "labels": {"severity": "ticket"}}
    path = tmp_path / "r.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [rule]}]}))
    with pytest.raises(ConfigError) as exc:
        load_rule_file(path)
    assert list(bad)[0] in str(exc.value)



def test_identical_noisy_runs_judged_at_every_step_never_fire():
    """Judged anew at each of 3000 common steps (overlapping windows), same curve, 5 % per-step noise."""
    from precision_agent.detectors.ab import AbDetector
    from precision_agent.series.state import SeriesState
    for seed in range(3):
        det = AbDetector(AbParams())
        rnd = random.Random(seed)
        st = SeriesState(())
        hits = 0
        for step in range(1, 3001):
            level = 6.0 * math.exp(-step / 800) + 2.0
            for side in ("on", "off"):
                labels = (("fusion", side), ("job", "j"), ("run", f"llama-{side}"))
                sig = det.observe(Sample(labels, LOSS, level * (1 + rnd.gauss(0, 0.05)), step,
                                         SourcePos("x", step), 0.0, producer="megatron"), st)
                hits += sig is not None and type(sig).__name__ == "Hit"
        assert hits == 0, seed


def test_runs_named_after_their_files_still_pair(tmp_path):
    """The agent adds run=<file name>: llama_on.log and llama_off.log are still one pair."""
    from precision_agent.detectors.ab import AbDetector
    from precision_agent.series.state import SeriesState
    det, st = AbDetector(AbParams()), SeriesState(())
    out = []
    for step in range(1, 31):
        for side in ("on", "off"):
            labels = (("fusion", side), ("job", "llama"), ("run", f"llama_{side}"))
            v = math.nan if side == "on" and step == 25 else 3.0
            out.append(det.observe(Sample(labels, LOSS, v, step, SourcePos("x", step), 0.0), st))
    hits = [o for o in out if type(o).__name__ == "Hit"]
    assert hits and dict(hits[0].labels) == {"job": "llama"}  # (a state: the pipeline pages its onset once)
    assert hits[0].evidence["suspect_step"] == 25


def test_long_windows_do_not_overflow():
    p = AbParams(window=1000, min_steps=20)
    on, off = base(2500, 1), base(2500, 2)
    assert judge(curve(on), curve(off), p).verdict == "no_difference"


# --- precision-agent fusion ab, the CLI over two logs ----------------------------------------------

def _megatron_log(path, losses: dict[int, str], scales: dict[int, str] | None = None) -> None:
    with open(path, "w") as f:
        for it, loss in losses.items():
            scale = (scales or {}).get(it, "65536.0")
            f.write(f" iteration {it:>8}/    1000 | consumed samples: {it * 8:>12} | learning rate: 1.000000E-04 | "
                    f"global batch size:     8 | lm loss: {loss} | loss scale: {scale} | grad norm: 1.2 | "
                    f"number of skipped iterations:   0 | number of nan iterations:   0 |\n")


def _fusion_ab(on, off):
    import json
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "fusion", "ab", str(on), str(off), "--json"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.parametrize("case, verdict, rc", [("collapse_on", "fusion_suspected", 1), ("noise", "no_difference", 0),
                                               ("off_worse", "fusion_off_worse", 0), ("few", "insufficient_data", 2)])
def test_cli_verdicts_on_curve_pairs(tmp_path, case, verdict, rc):
    steps = 10 if case == "few" else 200
    on = {s: f"{v:.6E}" for s, v in base(steps, 21).items()}
    off = {s: f"{v * (1.05 if case == 'off_worse' else 1.0):.6E}" for s, v in base(steps, 22).items()}
    scales = None
    if case == "collapse_on":  # fusion on: the scale backs off from step 100 down to 1
        scales = {s: str(max(1.0, 65536.0 / 2 ** max(0, s - 100))) for s in on}
    _megatron_log(tmp_path / "on.log", on, scales)
    _megatron_log(tmp_path / "off.log", off)
    code, out = _fusion_ab(tmp_path / "on.log", tmp_path / "off.log")
    assert (out["verdict"], code) == (verdict, rc), out
    assert set(out) == {"verdict", "steps_compared", "evidence"}


def _borderline(steps: int = 200) -> tuple[dict[int, float], dict[int, float]]:
    """Fusion on 5 % higher on 34 of every 50 steps, 1 % lower on the rest: a sign test at
    p = 0.0077 in each half, significant at the shipped rule's alpha 0.01, not at 0.001."""
    off = {s: 3.0 for s in range(1, steps + 1)}
    on = {s: 3.0 * (1.05 if s % 50 < 34 else 0.99) for s in off}
    return on, off


def test_cli_judges_with_the_shipped_rules_parameters(tmp_path):
    """`fusion ab` on two logs says what the live FusionSuspected rule says of the same curves;
    --alpha / --min-gap override the rule's parameters."""
    import subprocess
    import sys
    on, off = _borderline()
    p = shipped()
    for s in on:
        feed(p, "off", s, LOSS, off[s])
        feed(p, "on", s, LOSS, on[s])
    live = [f.evidence for f in p.findings if f.rule == "FusionSuspected"]
    assert live and all(ev["check"] == "loss_gap" and ev["alpha"] == 0.01 for ev in live)
    description = [f for f in p.findings if f.rule == "FusionSuspected"][0].annotations["description"]
    assert "the loss with fusion=on is higher by a median 5 % (above 2 %)" in description, description
    _megatron_log(tmp_path / "on.log", {s: f"{v:.6E}" for s, v in on.items()})
    _megatron_log(tmp_path / "off.log", {s: f"{v:.6E}" for s, v in off.items()})
    code, out = _fusion_ab(tmp_path / "on.log", tmp_path / "off.log")
    assert (out["verdict"], code) == ("fusion_suspected", 1) and out["evidence"]["alpha"] == 0.01
    for extra in (["--alpha", "0.001"], ["--min-gap", "0.1"]):
        proc = subprocess.run([sys.executable, "-m", "precision_agent", "fusion", "ab", str(tmp_path / "on.log"),
                               str(tmp_path / "off.log"), "--json", *extra], capture_output=True, text=True, timeout=120)
        assert (json.loads(proc.stdout)["verdict"], proc.returncode) == ("no_difference", 0), extra
    proc = subprocess.run([sys.executable, "-m", "precision_agent", "fusion", "ab", str(tmp_path / "on.log"),
                           str(tmp_path / "off.log"), "--alpha", "0.9"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "alpha" in proc.stderr
