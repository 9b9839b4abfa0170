from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lmdock._cli.main import main


def test_config_mistake_is_one_line_and_exit_2(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (isolated / "lmdock.toml").write_text('[models.a]\nmodel = "x"\ncolour = "red"\n')
    assert main(["config", "check"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0
    assert "lmdock.toml: models.a.colour: unknown key 'colour'" in err


def test_config_check_accepts_a_good_file(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (isolated / "lmdock.toml").write_text('[models.a]\nmodel = "x"\n[models.a.backends.onnx]\nthreads = 2\n')
    assert main(["config", "check"]) == 0
    out = capsys.readouterr().out
    assert "OK (1 model: a)" in out
    assert "backends.onnx: backend not installed here" in out


def test_config_schema_is_json(isolated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["properties"]["models"]["additionalProperties"]["required"] == ["model"]


def test_missing_model_path_from_cli_has_no_traceback(tmp_path: Path) -> None:
    (tmp_path / "lmdock.toml").write_text('[models.a]\nmodel = "./gone"\n')
    out = subprocess.run([sys.executable, "-m", "lmdock._cli.main", "generate", "-m", "a", "hi"], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "models.a.model: model path" in out.stderr


def test_invalid_sampling_flag_is_reported(fake: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "-m", "m", "--backend", "fake", "--temperature", "-1", "ab"]) == 2
    assert "sampling_params.temperature: must be in [0.0, inf)" in capsys.readouterr().err


def test_generate_through_the_fake_backend(fake: object, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "-m", "m", "--backend", "fake", "--max-new-tokens", "5", "--temperature", "0", "--json", "ab"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out[0]["outputs"][0]["token_ids"]) <= 5


def test_a_late_ctrl_c_does_not_interrupt_the_exit() -> None:
    """Ctrl-C just as the command finishes (in the interpreter's atexit handlers, where torch's run)
    is ignored: no "Exception ignored ... KeyboardInterrupt" traceback, exit 0."""
    code = (
        "import atexit, os, signal, sys, time\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))\n"
        "from lmdock._cli.main import main\n"
        "sys.argv = ['lmdock', 'backends']\n"
        "sys.exit(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "KeyboardInterrupt" not in out.stderr, out.stderr
    assert out.returncode == 0
