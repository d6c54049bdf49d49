"""The config file named by --config or TRACEPROXY_CONFIG: a regular file, a pipe or a
character device is read up to a config's size (--config <(envsubst < tpl) and
--config /dev/stdin are Unix habits); a directory, a FIFO no one writes to, or too
much is an error naming the flag or variable that named it, never a read that blocks
or never ends."""

from __future__ import annotations

import fcntl
import os
import resource
import subprocess
import struct
import sys
import termios
import threading
import time
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


def _clean_environment() -> dict[str, str]:
    clean = {name: value for name, value in os.environ.items() if not name.startswith(("TRACEPROXY_", "OTEL_"))}
    return {**clean, "PYTHONPATH": str(ROOT)}


def _run(command: list[str], cwd: Path, **options) -> subprocess.CompletedProcess:
    """``command`` in a clean environment, bounded in time and memory."""
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=30,
                          env=_clean_environment(), preexec_fn=_bounded_memory, **options)


CHECK = [sys.executable, "-m", "traceproxy", "serve", "--check", "--admin", "off"]


def _check(config: str, cwd: Path, **options) -> subprocess.CompletedProcess:
    """``traceproxy serve --check --config config``."""
    return _run([*CHECK, "--config", config], cwd, **options)


def _spans_setting(cwd: Path) -> tuple[str, str]:
    """A config that sets a key serve --check shows, and the line that shows it."""
    spans = cwd / "from-the-pipe.jsonl"
    return f'[tracing]\nfile_path = "{spans}"\n', f"spans       {spans}\n"


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


def test_a_fifo_no_one_writes_to_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    checked = _check(str(fifo), tmp_path)
    assert checked.returncode == 2, checked.stderr[-2000:]
    assert checked.stderr == f"traceproxy: configuration error: config file {fifo} (from flag --config) is a FIFO " \
                             "that gave nothing: is anything writing to it?\n"


def test_a_process_substitution_is_read_as_the_config_file(tmp_path):
    config, shown = _spans_setting(tmp_path)
    (tmp_path / "template.toml").write_text(config)
    command = " ".join([*CHECK, "--config", "<(cat template.toml)"])
    checked = _run(["bash", "-c", command], tmp_path)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert shown in checked.stdout


def test_a_pipe_is_read_to_its_end_when_its_writer_pauses(tmp_path):
    # A template tool may write its output in parts: one read gives only what is there,
    # and a read before the next part must wait for it, not fail or stop.
    config, shown = _spans_setting(tmp_path)
    first, rest = config.split("\n", 1)
    read_end, write_end = os.pipe()
    check = subprocess.Popen([*CHECK, "--config", f"/dev/fd/{read_end}"], cwd=tmp_path, pass_fds=(read_end,),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_clean_environment(), preexec_fn=_bounded_memory)
    os.close(read_end)
    try:
        os.write(write_end, (first + "\n").encode())
        for _ in range(400):  # until the check has read the first part (at most 20 s)
            if check.poll() is not None or _unread(write_end) == 0:
                break
            time.sleep(0.05)
        time.sleep(0.2)  # and is waiting for the rest
        os.write(write_end, rest.encode())
    except BrokenPipeError:  # the check stopped reading: its output says why
        pass
    finally:
        os.close(write_end)
    stdout, stderr = check.communicate(timeout=30)
    assert check.returncode == 0, stderr[-2000:]
    assert shown in stdout


def _unread(pipe_end: int) -> int:
    """How many bytes are in the pipe, not yet read."""
    return struct.unpack("i", fcntl.ioctl(pipe_end, termios.FIONREAD, b"\0\0\0\0"))[0]


def test_standard_input_from_a_pipe_is_read_as_the_config_file(tmp_path):
    config, shown = _spans_setting(tmp_path)
    checked = _check("/dev/stdin", tmp_path, input=config)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert shown in checked.stdout


def test_a_pipe_that_gives_nothing_is_refused_not_taken_for_an_empty_config(tmp_path):
    checked = _check("/dev/stdin", tmp_path, input="")
    assert checked.returncode == 2, checked.stderr[-2000:]
    assert "config file /dev/stdin (from flag --config) is a FIFO that gave nothing: " \
           "is anything writing to it?" in checked.stderr


def test_a_named_fifo_is_read_from_its_writer(tmp_path):
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    config, shown = _spans_setting(tmp_path)

    def write() -> None:
        # open() for writing waits for the reader: the check, started just after.
        with open(fifo, "w") as writer:
            writer.write(config)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        checked = _check(str(fifo), tmp_path)
    finally:
        if writer.is_alive():  # the check never opened it: let the writer's open() return
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=10)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert shown in checked.stdout


def test_dev_null_is_an_empty_config_as_an_empty_file_is(tmp_path):
    empty = tmp_path / "empty.toml"
    empty.write_bytes(b"")
    for config in ("/dev/null", str(empty)):
        checked = _check(config, tmp_path)
        assert checked.returncode == 0, (config, checked.stderr[-2000:])
        assert checked.stdout.endswith("traceproxy: configuration OK\n")


def test_a_device_that_never_ends_is_refused_at_the_size_cap(tmp_path):
    checked = _check("/dev/zero", tmp_path)
    assert checked.returncode == 2, checked.stderr[-2000:]
    assert checked.stderr == "traceproxy: configuration error: config file /dev/zero (from flag --config) " \
                             "is over 1 MiB: is it the config file?\n"


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
    with pytest.raises(ConfigError, match=rf"^config file {path} \(from flag --config\) is not valid TOML: "):
        _load(str(path), "flag")
