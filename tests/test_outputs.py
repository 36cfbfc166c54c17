"""Files the tools write go through one writer (`plans.io`): atomic, the process umask, and never
replacing a link, a FIFO or a device; inputs that once gave tracebacks give one clear error."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from plans.errors import PlannerError
from plans.io import check_output, write_bytes_atomic, write_text_atomic
from tests.conftest import ROOT

PLAN = ROOT / "plans" / "tiny_ppo.json"
EST = ["--tp", "1", "--pp", "1", "--dp", "8", "--global-batch", "64", "--seq-len", "1024", "--micro-batch", "1"]


def _device(path: Path) -> bool:
    """A character device node (the kind of /dev/null) at `path`; False where this user cannot make one."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError):
        return False
    return True


def _special(tmp_path: Path) -> dict[str, Path]:
    """A symbolic link to a file, a FIFO, and (where allowed) a device node, by kind."""
    target = tmp_path / "target.json"
    target.write_text("precious\n")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    out = {"link": link, "fifo": fifo, "dangling": tmp_path / "dangling.json"}
    out["dangling"].symlink_to(tmp_path / "nowhere.json")
    if _device(tmp_path / "dev.json"):
        out["device"] = tmp_path / "dev.json"
    return out


def test_the_writer_refuses_links_fifos_and_devices_and_leaves_them_untouched(tmp_path: Path) -> None:
    for kind, path in _special(tmp_path).items():
        before = os.lstat(path)
        with pytest.raises(PlannerError, match="not a regular file; planner never replaces one"):
            write_text_atomic(path, "new\n")
        after = os.lstat(path)
        assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode), kind
    assert (tmp_path / "target.json").read_text() == "precious\n"
    assert not (tmp_path / "nowhere.json").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_the_writer_uses_the_umask_and_replaces_a_regular_file_atomically(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        write_bytes_atomic(tmp_path / "a" / "b.json", b"one")
        mode = stat.S_IMODE(os.stat(tmp_path / "a" / "b.json").st_mode)
        assert mode == 0o644  # 0666 & ~022, as open() gives, not mkstemp's 0600
        os.umask(0o077)
        write_bytes_atomic(tmp_path / "a" / "b.json", b"two")
        assert stat.S_IMODE(os.stat(tmp_path / "a" / "b.json").st_mode) == 0o600
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "b.json").read_bytes() == b"two"
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b.json"]


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "plan.json"
    path.write_text("old\n")

    def interrupted(*_args) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new\n")
    assert path.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_long_names_and_bad_parents_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(PlannerError, match=r"the file name is too long \(305 bytes"):
        check_output(tmp_path / ("x" * 300 + ".json"))
    (tmp_path / "file").write_text("")
    with pytest.raises(PlannerError, match="is a file, not a directory"):
        check_output(tmp_path / "file" / "plan.json")
    with pytest.raises(PlannerError, match="it is a directory"):
        check_output(tmp_path)


@pytest.mark.parametrize("command", [
    ["export", str(PLAN), "--to", "verl", "-o", "{out}"],
    ["timeline", str(PLAN), "-o", "{out}.png", "--trace", "{out}"],
    ["replan", str(PLAN), "--cluster", "cpu:1x2", "--time-limit", "0", "-o", "{out}"],
    ["compile", str(ROOT / "examples" / "tiny_ppo.py"), "--time-limit", "0", "-o", "{out}"],
])
def test_every_command_refuses_to_write_through_a_link_or_onto_a_fifo_or_device(cli, tmp_path: Path,
                                                                                 command: list[str]) -> None:
    for kind, path in _special(tmp_path).items():
        before = os.lstat(path)
        r = cli(*[a.replace("{out}", str(path)) for a in command])
        assert r.code == 2 and "not a regular file; planner never replaces one" in r.err, (kind, r.err)
        assert "Traceback" not in r.err
        assert os.lstat(path).st_ino == before.st_ino and stat.S_IFMT(os.lstat(path).st_mode) == \
            stat.S_IFMT(before.st_mode), kind
    assert (tmp_path / "target.json").read_text() == "precious\n"


def test_a_graph_files_print_goes_to_stderr_so_json_stays_valid(cli, tmp_path: Path) -> None:
    graph = tmp_path / "chatty.py"
    graph.write_text((ROOT / "examples" / "tiny_ppo.py").read_text() + "\nprint('hello from the graph file')\n")
    r = cli("compile", str(graph), "--time-limit", "0", "--json")
    assert r.code == 0, r.err
    assert json.loads(r.out)["name"] == "tiny_ppo"
    assert "hello from the graph file" in r.err


@pytest.mark.parametrize(("body", "message"), [
    ("import os\nos._exit(0)\n", "called os._exit(0) instead of defining a graph"),
    ("class Stop(BaseException):\n    pass\nraise Stop('no')\n", "the graph file raised Stop: no"),
    ("def build():\n    import os\n    os._exit(3)\n", "build() called os._exit(3)"),
    ("raise GeneratorExit('odd')\n", "raised GeneratorExit: odd"),
])
def test_a_graph_file_that_exits_or_raises_a_base_exception_is_a_clear_error(cli, tmp_path: Path, body: str,
                                                                            message: str) -> None:
    graph = tmp_path / "bad.py"
    graph.write_text(body)
    r = cli("compile", str(graph), "--cluster", "cpu:1x4")
    assert r.code == 2 and message in r.err and "Traceback" not in r.err, r.err


def test_numbers_too_long_to_read_are_clear_errors(cli, tmp_path: Path) -> None:
    huge = "9" * 5000
    plan = json.loads(PLAN.read_text())
    text = json.dumps(plan).replace('"seqs": 16', f'"seqs": {huge}', 1)
    (tmp_path / "plan.json").write_text(text)
    (tmp_path / "config.json").write_text(f'{{"model_type": "llama", "hidden_size": {huge}}}')
    (tmp_path / "cal.json").write_text(f'{{"format": "planner-calibration/1", "x": {huge}}}')
    (tmp_path / "cluster.json").write_text(f'{{"gpu": "a100-80gb", "nodes": {huge}, "gpus_per_node": 8}}')
    cases = [
        (["validate", str(tmp_path / "plan.json")], "holds a number too long to read"),
        (["estimate", "--model", str(tmp_path / "config.json"), "--cluster", "a100-80gb:1x8", *EST],
         "holds a number too long to read"),
        (["estimate", "--model", "llama-2-7b", "--cluster", "a100-80gb:1x8", "--calibration", str(tmp_path / "cal.json"),
          *EST],
         "holds a number too long to read"),
        (["estimate", "--model", "llama-2-7b", "--cluster", str(tmp_path / "cluster.json"), *EST], "cluster file"),
    ]
    for args, message in cases:
        r = cli(*args)
        assert r.code == 2 and message in r.err and "Traceback" not in r.err, (args, r.err)


def test_a_300_character_file_name_is_a_clear_error_everywhere(cli, tmp_path: Path) -> None:
    long = str(tmp_path / ("p" * 300 + ".json"))
    for args in (["validate", long], ["show", long], ["export", str(PLAN), "--to", "verl", "-o", long],
                 ["compile", long], ["estimate", "--model", long, "--cluster", "a100-80gb:1x8", *EST],
                 ["estimate", "--model", "llama-2-7b", "--cluster", long, *EST]):
        r = cli(*args)
        assert r.code == 2 and "Traceback" not in r.err and r.err.strip(), (args, r.err)
