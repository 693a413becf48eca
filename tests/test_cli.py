"""The `hfleet` command as a user meets it: help, import hygiene, the exit-code table."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

import hybridfleet.errors as errors
from hybridfleet.cli.app import main


def test_help_lists_every_command_group():
    out = subprocess.run([sys.executable, "-m", "hybridfleet", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for group in ("spec", "env", "image", "certs", "run", "ps", "worker", "launch", "k8s", "ckpt"):
        assert f" {group} " in out, group


def test_importing_hybridfleet_and_its_cli_imports_neither_framework():
    code = ("import sys, hybridfleet, hybridfleet.cli.app, hybridfleet.ps.worker.session, hybridfleet.ps.server.service, "
            "hybridfleet.launch.psjob, hybridfleet.codec, hybridfleet.ckpt, hybridfleet.env.check; "
            "bad = [m for m in ('torch', 'paddle') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_error_kind_has_an_exit_code_and_hint():
    kinds = {cls.kind for cls in vars(errors).values()
             if isinstance(cls, type) and issubclass(cls, errors.HfleetError)}
    assert kinds <= set(errors.EXIT_CODES)
    codes = [c.code for k, c in errors.EXIT_CODES.items() if k != "usage"]
    assert len(codes) == len(set(codes))
    assert errors.EXIT_CODES["usage"].code == 2  # click's own usage exit code, shared with job-file errors
    assert all(c.hint for k, c in errors.EXIT_CODES.items() if k != "ok")


def test_unknown_command_is_a_usage_error_not_a_traceback():
    result = subprocess.run([sys.executable, "-m", "hybridfleet", "frobnicate"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr


def test_worker_command_derives_the_global_rank_from_site_and_site_rank(tmp_path):
    import json

    import yaml

    script = tmp_path / "show_env.py"
    script.write_text("import json, os\nprint(json.dumps({k: v for k, v in os.environ.items() if k.startswith('HFLEET_')}))\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "ranks", "framework": "torch", "entrypoint": str(script),
                                   "sites": {"a": {"workers": 2}, "b": {"workers": 3}}}))
    out = subprocess.run([sys.executable, "-m", "hybridfleet", "worker", str(job), "--site", "b", "--site-rank", "2",
                          "--servers", "127.0.0.1:50051", "--insecure-plaintext"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    env = json.loads(out.strip().splitlines()[-1])
    assert (env["HFLEET_RANK"], env["HFLEET_SITE_RANK"], env["HFLEET_SITE"]) == ("4", "2", "b")
    assert env["HFLEET_INSECURE"] == "1" and env["HFLEET_SERVERS"] == "127.0.0.1:50051"
    bad = subprocess.run([sys.executable, "-m", "hybridfleet", "worker", str(job), "--site", "b", "--site-rank", "3",
                          "--servers", "127.0.0.1:50051"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "must be in 0..2 for site 'b' (got 3)" in bad.stderr


def test_ps_serve_without_certs_or_explicit_plaintext_is_a_usage_error_and_serves_nothing(tmp_path):
    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "nocerts", "framework": "torch", "entrypoint": "train.py", "mode": "ps",
                                   "sites": {"a": {"workers": 1}}, "ps": {"shards": 2}}))
    port_file = tmp_path / "shard.port"
    for extra, message in ((["--shard", "0"], "--certs DIR is required"),
                           (["--shard", "0", "--insecure-plaintext"], "--certs DIR is required"),
                           (["--shard", "2", "--insecure-plaintext", "--no-auth"], "must be in 0..1 for a job of 2")):
        bad = subprocess.run([sys.executable, "-m", "hybridfleet", "ps", "serve", str(job), *extra, "--port", "0",
                              "--port-file", str(port_file)], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2, bad.stderr
        assert message in bad.stderr and "Traceback" not in bad.stderr
        assert not port_file.exists()  # nothing started serving


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 0)])
def test_ps_serve_exits_130_on_ctrl_c_and_0_when_stopped_with_sigterm(tmp_path, signum, code):
    import time

    import yaml

    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "stopme", "framework": "torch", "entrypoint": "train.py", "mode": "ps",
                                   "sites": {"a": {"workers": 1}}, "ps": {"shards": 1}}))
    port_file = tmp_path / "shard.port"
    shard = subprocess.Popen([sys.executable, "-m", "hybridfleet", "ps", "serve", str(job), "--shard", "0", "--port",
                              "0", "--host", "127.0.0.1", "--insecure-plaintext", "--no-auth", "--port-file",
                              str(port_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists() and time.monotonic() < deadline and shard.poll() is None:
            time.sleep(0.001)  # signal as soon as the file appears: a supervisor may stop the shard at once
        assert port_file.exists(), shard.stderr.read() if shard.poll() is not None else "no port file"
        shard.send_signal(signum)
        _out, err = shard.communicate(timeout=30)
    finally:
        if shard.poll() is None:
            shard.kill()
    assert shard.returncode == code, err
    assert "Traceback" not in err
    if signum == signal.SIGINT:
        assert "error: interrupted by Ctrl-C" in err


def test_the_exit_code_table_in_the_docs_is_the_one_in_errors():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = (int(cells[1]), "" if cells[2] == "-" else cells[2])
    assert rows == {kind: (c.code, c.hint) for kind, c in errors.EXIT_CODES.items()}


def test_an_internal_error_is_one_line_and_its_traceback_goes_to_a_file(monkeypatch, capsys, tmp_path):
    # Prepare: a bug inside a command (not a user mistake)
    import re

    from hybridfleet.cli import spec as spec_cli

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)

    def broken(path):
        return {}["missing"]

    monkeypatch.setattr(spec_cli, "load_spec", broken)
    # Execute
    with pytest.raises(SystemExit) as exit_info:
        main(["spec", "check", "job.yaml"])
    # Assert
    err = capsys.readouterr().err
    assert exit_info.value.code == errors.EXIT_CODES["error"].code
    assert "Traceback" not in err and "error: internal error: KeyError: 'missing'" in err
    path = re.search(r"the full traceback is in (\S+);", err).group(1)
    assert path.startswith(str(tmp_path)) and "Traceback" in open(path).read() and "broken" in open(path).read()


def test_ctrl_c_in_a_command_is_one_line_and_exit_130(monkeypatch, capsys):
    from hybridfleet.cli import spec as spec_cli

    def interrupted(path):
        raise KeyboardInterrupt

    monkeypatch.setattr(spec_cli, "load_spec", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        main(["spec", "check", "job.yaml"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 130 and err.startswith("error: interrupted by Ctrl-C") and "Traceback" not in err


def _commands(command, path=()):
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_help_text_shows_plain_metavars():
    # Prepare: the whole command tree as `hfleet` runs it
    import re

    import typer

    from hybridfleet.cli.app import build_app, plain_metavars

    root = plain_metavars(typer.main.get_command(build_app()))
    typer_style = re.compile(r"\{[A-Za-z_]+\}|<(?:str|int|float|path|bool|file|list\[[a-z]+\])>")
    checked = 0
    for path, command in _commands(root):
        # Execute
        ctx = command.make_context(" ".join(("hfleet", *path)), ["--help"], resilient_parsing=True)
        text = command.get_help(ctx)
        # Assert: `hfleet k8s quota JOB`, `--step STEP`; never `{job}` or `<int>`
        assert not typer_style.search(text), (path, typer_style.search(text).group(0))
        checked += 1
    assert checked > 40  # every group and command was looked at


def test_help_of_a_command_reads_like_argparse(capsys):
    main(["k8s", "quota", "--help"])  # returns normally: exit 0
    out = capsys.readouterr().out
    assert "Usage: hfleet k8s quota [OPTIONS] JOB" in out
    assert "--jobs JOBS" in out and "<int>" not in out
