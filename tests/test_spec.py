"""Job spec: defaults, unknown keys, wrong types and missing fields give field-path errors."""

from __future__ import annotations

import pytest
import yaml

from hybridfleet.cli.app import main
from hybridfleet.errors import SpecError
from hybridfleet.spec import load_spec, parse_spec

MINIMAL = {"name": "digits", "framework": "torch", "entrypoint": "train.py"}


def test_minimal_spec_gets_defaults():
    spec = parse_spec(dict(MINIMAL))
    assert spec.mode == "ps"
    assert spec.ps.sync == "bsp"
    assert spec.security.tls == "auto"
    assert spec.num_workers == 1


def test_unknown_key_names_its_path():
    with pytest.raises(SpecError) as err:
        parse_spec({**MINIMAL, "ps": {"shardz": 2}})
    assert "ps.shardz: unknown key (got 2)" in str(err.value)


def test_wrong_type_names_path_value_and_fix():
    with pytest.raises(SpecError) as err:
        parse_spec({**MINIMAL, "sites": {"cloud": {"workers": 0}}, "ps": {"sync": "sometimes"}})
    text = str(err.value)
    assert "sites.cloud.workers: input should be greater than or equal to 1 (got 0)" in text
    assert "ps.sync: input should be 'bsp', 'ssp', 'asp' or 'local' (got 'sometimes')" in text


def test_missing_field_is_reported():
    with pytest.raises(SpecError) as err:
        parse_spec({"framework": "paddle", "entrypoint": "train.py"})
    assert "name: required field is missing" in str(err.value)


def test_cross_field_rule_names_the_field():
    with pytest.raises(SpecError) as err:
        parse_spec({**MINIMAL, "ps": {"optimizer": {"name": "adam", "nesterov": True}}})
    assert "ps.optimizer.nesterov: needs name: sgd and momentum > 0" in str(err.value)


def test_non_mapping_and_bad_yaml(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(SpecError, match="a job file is a YAML mapping"):
        load_spec(bad)
    bad.write_text("name: [unclosed\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)


@pytest.mark.parametrize("framework", ["torch", "paddle"])
def test_cli_spec_check_prints_resolved_spec(tmp_path, capsys, framework, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the entrypoint train.py is relative to where the command runs
    (tmp_path / "train.py").write_text("pass\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**MINIMAL, "framework": framework}))
    main(["spec", "check", str(job)])
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["framework"] == framework
    assert resolved["ps"]["optimizer"]["name"] == "sgd"


def test_cli_spec_check_exit_code_2_on_error(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({**MINIMAL, "colour": "blue"}))
    with pytest.raises(SystemExit) as ex:
        main(["spec", "check", str(job)])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert "colour: unknown key" in err
    assert "hint:" in err


def test_compression_options_for_sparse_codecs_only():
    with pytest.raises(SpecError) as err:
        parse_spec({**MINIMAL, "ps": {"compression": {"codec": "sign", "momentum": 0.9}}})
    assert "ps.compression.momentum: only applies to codec topk or randomk (codec is 'sign')" in str(err.value)
    spec = parse_spec({**MINIMAL, "ps": {"compression": {"codec": "topk", "momentum": 0.9, "warmup_steps": 50,
                                                          "value_dtype": "float16"}}})
    assert spec.ps.compression.momentum == 0.9
