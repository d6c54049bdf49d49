"""The config file named by --config or TRACEPROXY_CONFIG: only a regular file of a
config's size is read; anything else is an error naming the flag or variable that
named it, never a read that blocks or never ends."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from traceproxy.config import ConfigError, load_settings

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024


def _load(path: str, via: str):
    if via == "flag":
        return load_settings({"config": path}, environ={})
    return load_settings(environ={"TRACEPROXY_CONFIG": path})


SOURCE = {"flag": "flag --config", "env": "env TRACEPROXY_CONFIG"}


def _bounded_memory() -> None:
    # A reader that does not stop at a size would fill memory from /dev/zero: here it
    # fails with MemoryError instead of taking the machine.
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def _check(config: str, cwd: Path) -> subprocess.CompletedProcess:
    """``traceproxy serve --check --config config`` in a clean environment, bounded in time and memory."""
    clean = {name: value for name, value in os.environ.items() if not name.startswith(("TRACEPROXY_", "OTEL_"))}
    return subprocess.run([sys.executable, "-m", "traceproxy", "serve", "--check", "--admin", "off",
                           "--config", config], cwd=cwd, capture_output=True, text=True, timeout=30,
                          env={**clean, "PYTHONPATH": str(ROOT)}, preexec_fn=_bounded_memory)


@pytest.mark.parametrize("via", ["flag", "env"])
def test_an_empty_config_path_is_said_to_be_empty(via):
    with pytest.raises(ConfigError) as error:
        _load("", via)
    message = str(error.value)
    assert message.startswith(f"the config file's path (from {SOURCE[via]}) is empty")
    assert "does not exist" not in message


@pytest.mark.parametrize("via", ["flag", "env"])
def test_a_directory_is_not_a_config_file(tmp_path, via):
    with pytest.raises(ConfigError) as error:
        _load(str(tmp_path), via)
    assert str(error.value).startswith(f"config file {tmp_path} (from {SOURCE[via]}) is a directory, not a file")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    checked = _check(str(fifo), tmp_path)
    assert checked.returncode == 2, checked.stderr[-2000:]
    assert checked.stderr == f"traceproxy: configuration error: config file {fifo} (from flag --config) is a FIFO, " \
                             "not a file: expected the path of a TOML file\n"


def test_a_device_is_refused_without_reading_it(tmp_path):
    checked = _check("/dev/zero", tmp_path)
    assert checked.returncode == 2, checked.stderr[-2000:]
    assert "config file /dev/zero (from flag --config) is a character device, not a file" in checked.stderr


def test_a_file_over_a_mebibyte_is_not_taken_for_a_config_file(tmp_path):
    path = tmp_path / "traceproxy.toml"
    path.write_bytes(b"#" * MIB + b"\n")
    with pytest.raises(ConfigError) as error:
        _load(str(path), "env")
    assert str(error.value) == (f"config file {path} (from env TRACEPROXY_CONFIG) is over 1 MiB: "
                                "is it the config file?")


def test_a_config_file_of_a_whole_mebibyte_is_read(tmp_path):
    path = tmp_path / "traceproxy.toml"
    setting = b"workers = 3\n"
    path.write_bytes(setting + b"#" * (MIB - len(setting) - 1) + b"\n")
    assert path.stat().st_size == MIB
    assert _load(str(path), "flag").workers == 3


def test_a_config_file_that_starts_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "traceproxy.toml"
    path.write_text("workers = 2\n[timeouts]\nconnect = 3\n", encoding="utf-8-sig")
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    settings = _load(str(path), "env")
    assert (settings.workers, settings.timeouts.connect) == (2, 3.0)


def test_a_byte_order_mark_inside_the_file_is_still_not_toml(tmp_path):
    path = tmp_path / "traceproxy.toml"
    path.write_text("workers = 2\n\ufeffadmin = \"off\"\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        _load(str(path), "flag")
