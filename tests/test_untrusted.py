"""The one reader of files anyone could have written (rope_extend.untrusted), and the one bounded repr."""

import json
import os
import time

import pytest

from rope_extend.errors import RopeExtendError
from rope_extend.untrusted import decode_json, head, read_bytes, read_json, read_object, read_text, shown

FIX = "give the file the test wrote"


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and len(text) < 500, text
    return text


@pytest.fixture
def good(tmp_path):
    path = tmp_path / "good.json"
    path.write_text('{"a": [1, 2]}')
    return path


def test_a_regular_file_is_read_through_a_link_only_when_links_are_followed(tmp_path, good):
    assert read_object(good) == {"a": [1, 2]}
    link = tmp_path / "link.json"
    link.symlink_to(good)
    assert read_json(link) == {"a": [1, 2]}  # a user's input: a hub cache's config.json is a link to a blob
    with pytest.raises(RopeExtendError) as info:
        read_json(link, follow_links=False, fix=FIX)  # a file rope-extend made: a link there is someone else's
    assert one_line(info) == (
        f"{link} is a symbolic link: rope-extend never reads a file it wrote through a link: {FIX}"
    )
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(RopeExtendError, match=r"dangling\.json is a link to nothing \(.*nowhere\)"):
        read_json(dangling)
    with pytest.raises(RopeExtendError, match=r"^the note \S+missing\.json: no such file: give it$"):
        read_json(tmp_path / "missing.json", name=f"the note {tmp_path / 'missing.json'}", fix="give it")


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        (lambda p: os.mkfifo(p), "is a named pipe, not a regular file"),
        (lambda p: p.mkdir(), "is a folder, not a file"),
        (lambda p: p.symlink_to("/dev/zero"), "is a socket or device, not a regular file"),
    ],
    ids=["fifo", "folder", "device"],
)
@pytest.mark.parametrize("follow_links", [True, False])
def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path, plant, said, follow_links):
    """A named pipe would block the reader until something writes to it, a device never ends: both refused
    before a byte is read, in well under a second."""
    path = tmp_path / "state.json"
    plant(path)
    if not follow_links and path.is_symlink():
        said = "is a symbolic link"
    start = time.monotonic()
    for read in (read_json, read_text, read_bytes):
        with pytest.raises(RopeExtendError) as info:
            read(path, limit=1 << 20, follow_links=follow_links, fix=FIX)
        assert one_line(info).startswith(f"{path} {said}") and one_line(info).endswith(FIX)
    assert time.monotonic() - start < 2


def test_a_file_larger_than_the_limit_is_refused_naming_the_limit_and_what_it_should_be(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b"")
    os.truncate(path, 4 << 30)  # 4 GiB, sparse: refused by its size, never read
    start = time.monotonic()
    with pytest.raises(RopeExtendError) as info:
        read_json(path, limit=1 << 20, name=f"the state {path}", fix="a state is a few kB")
    assert one_line(info) == f"the state {path} is larger than 1048576 bytes: a state is a few kB"
    assert time.monotonic() - start < 1
    path.write_bytes(b"x" * 101)
    with pytest.raises(RopeExtendError, match=r"is larger than 100 bytes"):
        read_bytes(path, limit=100)
    assert read_bytes(path, limit=101) == b"x" * 101
    assert head(path, 4) == b"xxxx"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (b'{"a": "\xff"}', "is not UTF-8 text (byte 7)"),
        (b"{not json", "is not valid JSON (Expecting property name"),
        (b"", "is not valid JSON (Expecting value: line 1 column 1 (char 0))"),
        (b"[" * 100_000, "is nested too deeply to be read as JSON"),
        (b"1" * 5000, "is not valid JSON (Exceeds the limit (4300 digits)"),
    ],
    ids=["not utf-8", "not json", "empty", "deep", "huge integer"],
)
def test_damaged_content_is_one_line(tmp_path, content, said):
    path = tmp_path / "damaged.json"
    path.write_bytes(content)
    with pytest.raises(RopeExtendError) as info:
        read_json(path, fix=FIX)
    line = one_line(info)
    assert line.startswith(f"{path} {said}") and line.endswith(FIX), line


@pytest.mark.parametrize(
    ("text", "kind"), [("[1]", "a list"), ('"x"', "a string"), ("null", "null"), ("3", "a number")]
)
def test_an_object_is_a_json_object(tmp_path, text, kind):
    path = tmp_path / "x.json"
    path.write_text(text)
    with pytest.raises(RopeExtendError, match=rf"x\.json holds {kind}, not a JSON object: {FIX}$"):
        read_object(path, fix=FIX)


def test_invalid_json_may_be_skipped_but_never_json_that_was_made():
    """A records line cut short by a kill is invalid JSON (skipped: it is measured again); a line nested past any
    record, or holding a 5000-digit number, was made that way: always refused."""
    cut = object()
    assert decode_json('{"task": "pass', "records.jsonl:3", invalid=cut) is cut
    assert decode_json(b'{"a": 1}', "x") == {"a": 1}
    for made in ("[" * 5000 + "]" * 5000, "1" * 5000):
        with pytest.raises(RopeExtendError, match=r"^records\.jsonl:3 is (nested too deeply|not valid JSON)"):
            decode_json(made, "records.jsonl:3", invalid=cut)


def test_shown_is_short_and_quick_whatever_the_value():
    huge = {
        "string": "x" * (100 << 20),
        "list": list(range(5_000_000)),
        "nested": json.loads("[" * 900 + "]" * 900),
        "integer": 7**20_000,
        "mapping": {str(i): i for i in range(3_000_000)},
    }
    start = time.monotonic()
    for name, value in huge.items():
        text = shown(value)
        assert len(text) <= 300 and "\n" not in text, name
        assert len(shown(value, 60)) <= 60, name
    assert time.monotonic() - start < 0.5
    assert shown("abc") == "'abc'" and shown([1, 2]) == "[1, 2]"  # a short value is its repr
    assert shown(7**20_000) == f"<an integer of {(7**20_000).bit_length()} bits>"
    assert shown({"b": 1, "a": [1, {"c": 2}]}) == "{'b': 1, 'a': [1, {'c': 2}]}"


def test_read_text_reads_line_endings_as_text_mode_does(tmp_path):
    """Windows (CRLF) and old Mac (CR) line endings are read as ``Path.read_text`` reads them: a corpus saved
    on Windows is the same text, hence the same tokens, as one saved elsewhere (the Canterbury texts are CRLF)."""
    path = tmp_path / "a.txt"
    path.write_bytes(b"one\r\ntwo\rthree\n\r\nfour\r")
    assert read_text(path, limit=1 << 10) == path.read_text(encoding="utf-8") == "one\ntwo\nthree\n\nfour\n"
