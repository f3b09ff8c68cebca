"""The shipped rule files' parse at build time (``rules/parsed.jsonl``, engine/rulefile.py
``shipped_parsed``): rule loading takes a file's data from it when the file's bytes match, and
parses YAML otherwise. It must stay equal to the YAML, and the rules in force must not depend on
which way a file was read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import yaml

from precision_agent.config import load_yaml_mapping
from precision_agent.engine.rulefile import PARSED, default_rules_dir, load_rules, shipped_parsed
from support.commands import cli_modules
from support.rule_twin import twin_text

def _scan(*args: object) -> tuple[int, dict, bool, str]:
    rc, out, modules, err = cli_modules("scan", "--json", *args)
    return rc, json.loads(out) if out.startswith("{") else {}, "yaml" in modules, err


def test_the_twin_is_up_to_date_with_the_shipped_yaml():
    committed = (default_rules_dir() / PARSED).read_text("utf-8")
    assert committed == twin_text(default_rules_dir()), (
        "rules/ changed: regenerate rules/parsed.jsonl with `python -m tests.support.rule_twin`")


def test_the_twin_gives_the_data_yaml_gives_for_every_shipped_file():
    files = sorted(p for p in default_rules_dir().iterdir() if p.suffix in (".yml", ".yaml"))
    assert files and len(shipped_parsed()) == len(files)
    for p in files:
        from_yaml = load_yaml_mapping(p)              # no twin given: PyYAML
        from_twin = load_yaml_mapping(p, shipped_parsed())
        assert repr(from_twin) == repr(from_yaml), p.name   # the same values, types and key order


def test_copies_and_edits_of_shipped_files_load_the_same_rules_as_yaml(tmp_path):
    shipped = load_rules([default_rules_dir()])
    assert not shipped.errors and len(shipped.rules) >= 30
    copy = tmp_path / "copy"
    shutil.copytree(default_rules_dir(), copy, ignore=shutil.ignore_patterns("*.py", PARSED, "tests", "__pycache__"))
    again = load_rules([copy])
    assert [(r.spec, r.group) for r in again.rules] == [(r.spec, r.group) for r in shipped.rules]
    # an edited copy no longer matches its twin: parsed as YAML, the edit is in force
    dumps = copy / "dumps.yml"
    data = yaml.safe_load(dumps.read_text())
    data["groups"][0]["rules"][0]["labels"]["severity"] = "info"
    dumps.write_text(yaml.safe_dump(data))
    edited = load_rules([dumps])
    assert edited.rules[0].severity == "info" and edited.rules[0].name == data["groups"][0]["rules"][0]["alert"]


def test_a_scan_with_the_shipped_rules_fires_them_without_parsing_yaml(tmp_path):
    a = np.ones(1000, np.float32)
    a[10] = np.nan
    np.save(tmp_path / "layer0.output.0.npy", a)
    rc, doc, yaml_loaded, err = _scan(tmp_path, "--jobs", "2")
    assert rc == 1, err                                   # a page: the NaN's finding
    assert doc["first_nonfinite"]["op"] and not yaml_loaded
    dump_rules = {r["alert"] for g in load_yaml_mapping(default_rules_dir() / "dumps.yml")["groups"] for r in g["rules"]}
    assert {f["rule"] for f in doc["findings"]} & dump_rules


def test_a_bad_rule_file_given_to_scan_still_fails_with_its_name_and_place(tmp_path):
    np.save(tmp_path / "t.npy", np.ones(4, np.float32))
    bad = tmp_path / "rules"
    bad.mkdir()
    (bad / "mine.yml").write_text("groups:\n  - name: g\n    rules:\n      - alert: X\n        kind: no_such_kind\n"
                                  "        labels: {severity: page}\n")
    rc, doc, yaml_loaded, err = _scan(tmp_path / "t.npy", "--rules", bad)
    assert rc == 2 and doc == {} and yaml_loaded
    assert "mine.yml" in err and 'rule "X"' in err and "unknown rule kind 'no_such_kind'" in err
    broken = bad / "mine.yml"
    broken.write_text("groups: [unclosed\n")
    rc, _, _, err = _scan(tmp_path / "t.npy", "--rules", bad)
    assert rc == 2 and "mine.yml" in err and "invalid YAML" in err


def test_a_damaged_twin_entry_falls_back_to_yaml(tmp_path):
    rules = tmp_path / "r.yml"
    rules.write_text("groups:\n  - name: g\n    rules: []\n")
    import hashlib
    sha = hashlib.sha256(rules.read_bytes()).hexdigest()
    for damaged in ('{"groups": [', '["not", "a", "mapping"]', "null"):
        assert load_yaml_mapping(rules, {sha: damaged}) == {"groups": [{"name": "g", "rules": []}]}
