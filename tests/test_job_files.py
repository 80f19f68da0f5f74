"""Job files and ``--set`` flags that cannot hang or mislead the CLI: alias bombs, equal keys,
dates, deep nesting, junk and malformed flags are refused naming the line or the flag, quickly.

Pure tests (the loader, the spec parser, the CLI's parse bound in-process) but one, which runs
``strata validate`` on an alias bomb as a real process."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from strata import safeyaml
from strata.errors import SpecError
from strata.spec import MAX_SPEC_DEPTH, apply_overrides, load_spec_file, parse_job_spec

#: the classic "billion laughs": 353 bytes, 9^9 strings once every alias is expanded
BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""
#: the alias on this line takes the document past safeyaml.MAX_NODES
BOMB_LINE = 6
MLP = "{builtin: {kind: mlp, input_shape: [64], hidden: [8], classes: 10}}"
GOOD = f"name: ok\nmodel: {MLP}\ndata: {{source: digits, batch_size: 64}}\n"


@pytest.fixture(params=safeyaml.LOADERS, ids=lambda c: c.__name__)
def loader(request, monkeypatch):
    """Each parser PyYAML has here (libyaml's and Python's): the rules hold with either."""
    monkeypatch.setattr(safeyaml, "LOADERS", (request.param,))
    return request.param


def job_file(tmp_path, text: str | bytes, name: str = "job.yaml") -> str:
    path = tmp_path / name
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    return str(path)


def refused(tmp_path, text: str | bytes) -> SpecError:
    path = job_file(tmp_path, text)
    with pytest.raises(SpecError) as e:
        load_spec_file(path)
    assert e.value.field == "JOB" and path in e.value.message, e.value
    assert "Traceback" not in e.value.message
    return e.value


def test_the_composer_is_this_modules_with_either_parser():
    # libyaml's own composer would build the whole document, aliases unchecked
    from yaml.composer import Composer

    for cls in safeyaml.LOADERS:
        assert cls.get_single_node is Composer.get_single_node
        assert cls.compose_node is safeyaml._Composer.compose_node


# --- aliases ---------------------------------------------------------------------------------

def test_alias_bomb_refused_naming_its_line(tmp_path, loader):
    t = time.process_time()
    e = refused(tmp_path, BOMB)
    assert time.process_time() - t < 1
    assert f"line {BOMB_LINE}:" in e.message and "alias *e" in e.message
    assert f"{safeyaml.MAX_NODES:,} nodes" in e.message


def test_alias_bomb_refused_by_validate_in_a_real_process(tmp_path):
    path = job_file(tmp_path, BOMB)
    t = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "strata.cli", "validate", path],
                       capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t
    assert r.returncode == 2, r.stderr
    assert elapsed < 5, f"{elapsed:.1f} s"  # interpreter start included; the parse is ~1 ms
    assert f"line {BOMB_LINE}" in r.stderr and path in r.stderr
    assert "Traceback" not in r.stderr


def test_anchors_aliases_and_merge_keys_still_load(tmp_path, loader):
    text = """\
name: anchored
model: {builtin: &mlp {kind: mlp, input_shape: [64], hidden: &h [32, 16], classes: 10}}
data: {source: digits, batch_size: &b 64}
training:
  <<: {epochs: 5, seed: 7}
  epochs: 2
  optimizer: {<<: [{name: sgd}, {name: adam, learning_rate: 0.5}]}
gradients: {accumulate: 1, pack_size: *b}
"""
    raw = load_spec_file(job_file(tmp_path, text))
    assert raw["model"]["builtin"]["hidden"] == [32, 16]
    # own keys win over merged ones; among merged mappings the earlier wins (YAML's merge key)
    assert raw["training"] == {"epochs": 2, "seed": 7,
                               "optimizer": {"name": "sgd", "learning_rate": 0.5}}
    spec = parse_job_spec(raw)
    assert spec.training.epochs == 2 and spec.training.optimizer.name == "sgd"
    assert spec.gradients.pack_size == "64"


def test_merge_order_does_not_depend_on_key_length(loader):
    # PyYAML 6.0.4's own merge lets the later mapping win for keys Python does not intern
    long = "a_key_long_enough_not_to_be_interned"
    text = (f"one: &one {{{long}: 1, b: 1}}\ntwo: &two {{{long}: 2, c: 2}}\n"
            f"both: {{<<: [*one, *two], b: 3}}\n")
    assert safeyaml.load(text, "t")["both"] == {long: 1, "b": 3, "c": 2}


def test_alias_inside_its_own_node_refused(loader):
    with pytest.raises(safeyaml.YamlRefused) as e:
        safeyaml.load("a: 1\nb: &b\n  c: [1, *b]\n", "t.yaml")
    assert e.value.line == 3 and "t.yaml line 3" in e.value.message
    assert isinstance(e.value, ValueError)


def test_many_plain_nodes_refused_like_aliases(loader):
    text = "".join(f"k{i}: v\n" for i in range(safeyaml.MAX_NODES // 2 + 10))
    with pytest.raises(safeyaml.YamlRefused, match="more than 100,000 nodes") as e:
        safeyaml.load(text, "big.yaml")
    assert e.value.line == safeyaml.MAX_NODES // 2


# --- duplicate keys --------------------------------------------------------------------------

@pytest.mark.parametrize("text,key,line,first", [
    ("name: a\nworkers: 1\nname: b\n", "name", 3, 1),
    ("name: a\ntraining:\n  epochs: 1\n  steps: 2\n  epochs: 3\n", "epochs", 5, 3),
    ("name: a\ndata: {source: digits,\n  source: npz}\n", "source", 3, 2),
    ("name: a\n1: x\n0x1: y\n", "1", 3, 2),  # equal once read, written differently
    ("name: a\nt: {<<: {a: 1}, <<: {b: 2}}\n", "<<", 2, 2),
], ids=["top", "nested", "flow", "equal-values", "two-merges"])
def test_duplicate_keys_refused_naming_key_and_both_lines(tmp_path, loader, text, key, line,
                                                          first):
    e = refused(tmp_path, text)
    assert f"line {line}:" in e.message and f"first on line {first}" in e.message
    assert repr(key) in e.message


def test_a_long_duplicate_key_is_quoted_at_most_64_characters(loader):
    key = "k" * 500
    with pytest.raises(safeyaml.YamlRefused) as e:
        safeyaml.load(f"{key}: 1\n{key}: 2\n", "t")
    assert repr("k" * 64) + "..." in e.value.message and "k" * 65 not in e.value.message


# --- dates, tags, strings --------------------------------------------------------------------

def test_date_like_name_stays_text_and_validates(tmp_path, loader):
    raw = load_spec_file(job_file(tmp_path, GOOD.replace("name: ok", "name: 2024-01-01")))
    assert raw["name"] == "2024-01-01"
    assert parse_job_spec(raw).name == "2024-01-01"
    assert apply_overrides(raw, ["name=2025-02-03"])["name"] == "2025-02-03"
    # only this module's resolver lost timestamps
    assert isinstance(yaml.safe_load("d: 2024-01-01")["d"], datetime.date)


@pytest.mark.parametrize("tag", ["!!timestamp 2024-01-01", "!!binary aGk=", "!!set {a}",
                                 "!!omap [a: 1]", "!!pairs [a: 1]"])
def test_tags_json_cannot_hold_are_refused(tmp_path, loader, tag):
    e = refused(tmp_path, f"name: x\nmodel:\n  x: {tag}\n")
    assert "line 3:" in e.message and "JSON" in e.message


@pytest.mark.parametrize("value", [2024, 1.5, True, False, datetime.date(2024, 1, 1)])
def test_a_name_that_is_not_text_says_to_quote_it(value):
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": value, "model": {"builtin": {}}})
    assert e.value.field == "name"
    assert "quote" in e.value.message and "required" not in e.value.message


@pytest.mark.parametrize("line", ["name: 123", "name: no", "name: 1.0"])
def test_a_name_yaml_reads_as_not_text_says_to_quote_it(tmp_path, line):
    raw = load_spec_file(job_file(tmp_path, GOOD.replace("name: ok", line)))
    with pytest.raises(SpecError) as e:
        parse_job_spec(raw)
    assert e.value.field == "name" and "quote" in e.value.message


def test_other_string_fields_say_to_quote_too():
    with pytest.raises(SpecError) as e:
        parse_job_spec({"name": "x", "model": {"builtin": {}},
                        "data": {"source": "csv", "path": 2024, "label": "y"}})
    assert e.value.field == "data.path" and "quote" in e.value.message


# --- depth, junk -----------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "name: " + "[" * 100_000 + "]" * 100_000,
    "name: x\nmodel: " + "{a: " * (MAX_SPEC_DEPTH + 1) + "1" + "}" * (MAX_SPEC_DEPTH + 1),
    "- " * 100_000 + "x",
    "".join(" " * i + f"k{i}:\n" for i in range(MAX_SPEC_DEPTH + 5)) + " " * 40 + "v",
    # 11 levels, aliased inside 24 more: deep only once the alias is expanded
    "a: &a " + "[" * 10 + "1" + "]" * 10 + "\nb: " + "[" * 24 + "*a" + "]" * 24,
], ids=["flow", "flow-maps", "block", "block-maps", "through-alias"])
def test_deep_nesting_is_a_clear_error_never_a_recursion_error(tmp_path, loader, text):
    e = refused(tmp_path, text)
    assert "nested too deeply" in e.message and f"{MAX_SPEC_DEPTH} levels" in e.message
    assert " line " in e.message


def test_32_levels_still_load(tmp_path, loader):
    deep = "{a: " * (MAX_SPEC_DEPTH - 2) + "1" + "}" * (MAX_SPEC_DEPTH - 2)
    assert load_spec_file(job_file(tmp_path, f"name: x\nmodel: {deep}\n"))["name"] == "x"


@pytest.mark.skipif(safeyaml.LOADERS[0].__name__ != "_CLoader",
                    reason="PyYAML without libyaml scans in Python: correct, not quick")
@pytest.mark.parametrize("junk", [
    b"[" * (16 << 20), b"a: 1\n" * ((16 << 20) // 5), b"#" * (16 << 20),
    b"- " * (8 << 20), b"\n" * (16 << 20), b"a: &x [*x]\n" + b" " * ((16 << 20) - 11),
], ids=["brackets", "repeated-key", "comment", "dashes", "newlines", "recursive-alias"])
def test_16_mib_of_junk_is_refused_in_well_under_a_second(tmp_path, junk):
    path = job_file(tmp_path, junk)
    assert os.path.getsize(path) <= 16 << 20
    t = time.process_time()
    with pytest.raises(SpecError) as e:
        load_spec_file(path)
    assert time.process_time() - t < 1, e.value
    assert e.value.field == "JOB"


@pytest.mark.parametrize("content,needle", [
    (b"name: x\nmodel: \x00\n", "line 2: character 0x0000"),
    (b"name: x\n---\nname: y\n", "line 2"),
    (b"name: [x\nworkers: 1\n", "not valid YAML"),
    (b"name: *nowhere\n", "line 1: not valid YAML: found undefined alias"),
    (b"- name\n", "must hold a mapping"),
])
def test_other_refusals_name_the_file_and_line(tmp_path, loader, content, needle):
    assert needle in refused(tmp_path, content).message


# --- --set -----------------------------------------------------------------------------------

BASE = {"name": "x", "model": {"builtin": {"hidden": [4]}}, "data": {"path": "d"}}
#: the bomb as one flow value: [&a [lol, ...], &b [*a, ...], ..., &i [*h, ...]]
BOMB_VALUE = "[" + ", ".join(f"&{c} [" + ", ".join([f"*{p}" if p else "lol"] * 9) + "]"
                             for p, c in zip([""] + list("abcdefgh"), "abcdefghi")) + "]"


@pytest.mark.parametrize("flags,needle", [
    (["..workers=1"], "'..workers=1': a field path is names joined by single dots"),
    (["workers.=1"], "field path"),
    (["a..b=1"], "field path"),
    ([" workers=1"], "field path"),
    (["workers =1"], "field path"),
    (["=1"], "field path"),
    (["trai-ning.epochs=1"], "field path"),
    (["workers"], "KEY=VALUE"),
    (["model.builtin.hidden=["], "model.builtin.hidden: not valid YAML"),
    (["name=[x"], "quote it: --set 'name=\"[x\"'"),
    (["data={a: 1, a: 2}"], "given twice"),
    (["model.builtin=" + BOMB_VALUE], "nodes with every alias expanded"),
    (["training.epochs=1"] * 1001, "1,001 flags; at most 1,000"),
    (["name=" + "x" * (65 << 10)], "at most 64 KiB"),
    ([".".join(["a"] * MAX_SPEC_DEPTH) + "=1"], "levels"),
    (["model.x=" + "[" * MAX_SPEC_DEPTH + "]" * MAX_SPEC_DEPTH], "nested too deeply"),
    (["name=\x00"], "character 0x0000"),
], ids=lambda v: v[0][:24] if isinstance(v, list) else None)
def test_bad_set_flags_refused_naming_the_flag(flags, needle):
    t = time.process_time()
    with pytest.raises(SpecError) as e:
        apply_overrides(BASE, flags)
    assert time.process_time() - t < 1
    assert e.value.field == "--set", e.value
    assert needle in e.value.message


def test_set_values_together_are_bounded():
    # each under the bound (60,001 nodes, a few KiB of text), together past it
    half = "[&x [" + ", ".join(["1"] * 99) + "]" + ", *x" * 599 + "]"
    with pytest.raises(SpecError, match="come to more than") as e:
        apply_overrides(BASE, [f"data.a{i}={half}" for i in range(2)])
    assert e.value.field == "--set"


def test_good_set_flags_are_applied():
    out = apply_overrides(BASE, ["training.epochs=3", "model.builtin.hidden=[8, 8]",
                                 'name="[x"', "data.path=", "memory.recompute=false",
                                 "data.label='2024-01-01'", "restart.backoff_s=2024-01-01"])
    assert out["training"]["epochs"] == 3
    assert out["model"]["builtin"]["hidden"] == [8, 8]
    assert out["name"] == "[x" and out["data"]["path"] == ""
    assert out["memory"]["recompute"] is False
    assert out["data"]["label"] == "2024-01-01" and out["restart"]["backoff_s"] == "2024-01-01"
    assert BASE["model"]["builtin"]["hidden"] == [4]  # the caller's mapping is untouched


def test_set_values_with_aliases_become_copies():
    out = apply_overrides({}, ["data={a: &x {k: 1}, b: *x}", "data.a.k=2"])
    assert out["data"] == {"a": {"k": 2}, "b": {"k": 1}}


def test_set_through_a_value_that_is_not_a_mapping_names_the_path():
    with pytest.raises(SpecError) as e:
        apply_overrides({"data": {"path": "p"}}, ["data.path.x=1"])
    assert e.value.field == "data.path"


# --- the CLI's time bound --------------------------------------------------------------------

def test_the_cli_refuses_a_parse_that_runs_past_its_limit(tmp_path, monkeypatch, capsys):
    from strata import cli, clicommon, spec

    path = job_file(tmp_path, GOOD)

    def slow(p):
        time.sleep(60)  # the timer's signal ends it

    monkeypatch.setattr(spec, "load_spec_file", slow)
    monkeypatch.setattr(clicommon, "PARSE_LIMIT_S", 0.2)
    handler = signal.getsignal(signal.SIGALRM)
    timer = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout's, if it runs on signals
    t = time.monotonic()
    assert cli.main(["validate", path]) == 2
    assert time.monotonic() - t < 10
    err = capsys.readouterr().err
    assert "JOB" in err and path in err and "0.2 s" in err and "Traceback" not in err
    assert signal.getsignal(signal.SIGALRM) is handler
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == (timer[0] > 0)


def test_the_cli_time_bound_lets_a_good_file_through(tmp_path):
    from strata.clicluster import DEMO_SPEC
    from strata.clicommon import _check_job

    handler = signal.getsignal(signal.SIGALRM)
    _check_job(job_file(tmp_path, GOOD), ["training.epochs=2"])
    assert signal.getsignal(signal.SIGALRM) is handler
    with pytest.raises(SpecError) as e:
        _check_job(DEMO_SPEC, ["..workers=1"])
    assert e.value.field == "--set"


# --- generated texts -------------------------------------------------------------------------

PIECES = ["name", "model", "builtin", "hidden", "data", "x", ":", ": ", " ", "  ", "\n", "\t",
          "- ", "[", "]", "{", "}", ",", "&a ", "*a", "&b ", "*b", "<<: ", "? ", "!!binary ",
          "!!set ", "!!str ", "!!timestamp ", "!!python/object ", "!x ", "'", '"', "#", "|",
          ">", "---", "...", "%YAML 1.1\n", "2024-01-01", "0x1F", "1", "1.5", "yes", "~", "null",
          "\\", "\x00", "é", "\ud800", "\ufeff", "=", "9" * 5000, "[" * 40, "{a: " * 35]
JUNK = st.lists(st.sampled_from(PIECES) | st.text(max_size=4), max_size=40).map("".join)
#: block mappings, mostly well formed: "key: value" lines of the job's own words, now and then
#: nested, repeated, anchored or aliased
LINES = st.lists(st.tuples(st.sampled_from(["", "", "", "  ", "    "]),
                           st.sampled_from(["name", "model", "builtin", "hidden", "data", "<<",
                                            "workers", "x"]),
                           st.sampled_from(["{i}", "{i}", "{i}", ""]),  # "": a repeated key
                           st.sampled_from(["1", "x", "2024-01-01", "[8, 8]", "{a: 1}", "~",
                                            "yes", "&a{i} [1, 2]", "*a0", "!!str 5", "'q'",
                                            '"d"', "0x1F", "", "&a{i} {b: 1}", "*a1", "[", ":"])),
                 max_size=12).map(lambda ls: "".join(
                     f"{ind}{key}{suffix}: {value}\n".replace("{i}", str(i))
                     for i, (ind, key, suffix, value) in enumerate(ls)))
TEXTS = JUNK | LINES
_FUZZ_FILE = os.path.join(tempfile.mkdtemp(prefix="strata-job-files-"), "job.yaml")


@settings(max_examples=1500, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS)
def test_generated_job_files_load_as_a_mapping_or_a_spec_error(text):
    with open(_FUZZ_FILE, "wb") as f:
        f.write(text.encode("utf-8", "surrogatepass"))
    try:
        raw = load_spec_file(_FUZZ_FILE)
    except SpecError as e:
        assert e.field == "JOB" and _FUZZ_FILE in e.message
        event("refused")
    else:
        assert isinstance(raw, dict)
        event("loaded")
    try:  # the same text as a --set value
        value = apply_overrides({}, [f"x={text}"])["x"]
    except SpecError as e:
        assert e.field == "--set"
    else:
        assert value is None or isinstance(value, (str, int, float, bool, list, dict))
