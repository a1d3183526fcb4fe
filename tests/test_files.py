"""``headrace.core.files``: an append-only log cuts a torn last line before it appends, keeps the
record an older version glued onto one, undoes a write cut short, and never opens through a link."""

from __future__ import annotations

import errno
import json

import pytest

from headrace.core import files
from headrace.core.files import AppendLog, LinkRefused, atomic_write


@pytest.mark.parametrize("torn", [b"{", b'{"id": "x", "ep', b'{"id": "x"}'])
def test_a_torn_last_line_is_skipped_and_cut_before_the_next_record(tmp_path, torn):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"id": "a"}\n' + torn)
    log = AppendLog(path)
    assert list(log.read()) == [{"id": "a"}]
    log.append({"id": "b"})
    log.close()
    assert path.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n'


def test_a_file_of_one_torn_line_is_emptied_and_a_missing_one_created(tmp_path):
    torn, missing = tmp_path / "torn.jsonl", tmp_path / "missing.jsonl"
    torn.write_bytes(b'{"step": 1, "pa')
    for path in (torn, missing):
        log = AppendLog(path, durable=True)
        log.append({"step": 2})
        log.close()
        assert path.read_bytes() == b'{"step": 2}\n'


def test_a_record_glued_onto_a_torn_line_by_an_older_version_is_read_back(tmp_path):
    path = tmp_path / "versions.jsonl"
    whole = {"line": 1, "version": 1, "outcome": "published", "metrics": {"loss": 0.5}}
    glued = '{"line": 1, "version": 1, "outcome": "pub' + json.dumps(whole)
    path.write_text(json.dumps({"line": 0}) + "\n" + glued + "\n" + "not json\n")
    bad: list[tuple[int, str]] = []
    assert list(AppendLog(path).read(lambda n, text: bad.append((n, text)))) == [{"line": 0}, whole]
    assert bad == [(3, "not json")]


def test_a_write_cut_short_by_a_full_disk_is_undone(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    log = AppendLog(path)
    log.append({"step": 0})

    class Full:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            self._f.write(data[:3])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self._f, name)

    log._file = Full(log._file)
    with pytest.raises(OSError):
        log.append({"step": 1})
    log._file = log._file._f
    log.append({"step": 1})
    log.close()
    assert path.read_bytes() == b'{"step": 0}\n{"step": 1}\n'


def test_no_file_is_written_or_read_through_a_symbolic_link(tmp_path):
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    link = tmp_path / "log.jsonl"
    link.symlink_to(precious)
    with pytest.raises(LinkRefused, match="is a symbolic link"):
        AppendLog(link).append({"x": 1})
    with pytest.raises(LinkRefused):
        list(AppendLog(link).read())
    with pytest.raises(LinkRefused):
        files.open_no_follow(link, "w")
    atomic_write(link, "new\n")  # replaces the link itself
    assert precious.read_text() == "keep me\n" and not link.is_symlink() and link.read_text() == "new\n"


def test_a_runs_log_cuts_a_torn_line_so_its_first_line_is_whole(tmp_path):
    from headrace.core import logs

    path = tmp_path / "log.jsonl"
    path.write_text('{"event": "step"}\n{"event": "ru')
    with logs.run_log(path):
        logs.get_logger().info("run_start", step=0)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["step", "run_start"]
