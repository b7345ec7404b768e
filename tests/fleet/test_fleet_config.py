"""The fleet file and --connect URLs: a good file reads back, every malformed one is refused naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from calconsole.fleet.config import MAX_BOARDS, FleetConfigError, from_urls, load_fleet


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "fleet.yaml"
    p.write_text(text, encoding="utf-8")
    return p


def test_a_fleet_file_reads_back(tmp_path: Path) -> None:
    (tmp_path / "keys").mkdir()
    p = write(tmp_path, """
refresh_hz: 2
timeout_s: 5
boards:
  - name: rack1-b0
    url: http://10.0.0.5:8080/
    api_key_file: keys/b0.api
  - {name: rack1-b1, url: "https://board1.example:9443", admin_key_file: /etc/calconsole/b1.admin}
""")
    cfg = load_fleet(p)
    assert cfg.refresh_hz == 2.0 and cfg.timeout_s == 5.0
    assert [b.name for b in cfg.boards] == ["rack1-b0", "rack1-b1"]
    assert cfg.boards[0].url == "http://10.0.0.5:8080"  # normalised: no trailing slash
    assert cfg.boards[0].api_key_file == str(tmp_path.resolve() / "keys" / "b0.api")  # relative to the file
    assert cfg.boards[1].admin_key_file == "/etc/calconsole/b1.admin"


@pytest.mark.parametrize(("text", "field", "words"), [
    ("[1, 2]", "<root>", "mapping"),
    ("boards: []", "boards", "non-empty"),
    ("boards: [{name: a, url: http://h:1}]\nextra: 1", "extra", "unknown key"),
    ("boards: [{name: a, url: http://h:1, colour: red}]", "boards[0].colour", "unknown key"),
    ("boards: [{name: 'a b', url: http://h:1}]", "boards[0].name", "A-Z"),
    ("boards: [{name: a, url: http://h:1}, {name: a, url: http://h:2}]", "boards[1].name", "twice"),
    ("boards: [{name: a, url: http://h:1}, {name: b, url: 'http://h:1/'}]", "boards[1].url", "another board"),
    ("boards: [{name: a, url: ftp://h:1}]", "boards[0].url", "http"),
    ("boards: [{name: a, url: 'http://h:1/v1'}]", "boards[0].url", "no path"),
    ("boards: [{name: a, url: 'http://user:pw@h:1'}]", "boards[0].url", "credentials"),
    ("boards: [{name: a, url: 'http://h:99999'}]", "boards[0].url", "not a URL"),
    ("boards: [{name: a, url: 8080}]", "boards[0].url", "http"),
    ("refresh_hz: 100\nboards: [{name: a, url: http://h:1}]", "refresh_hz", "[0.1, 10]"),
    ("timeout_s: .nan\nboards: [{name: a, url: http://h:1}]", "timeout_s", "0.5"),
    ("boards: [{name: a, url: http://h:1, api_key_file: 7}]", "boards[0].api_key_file", "file path"),
    ("a: &x [1]\nb: *x", "<yaml>", "anchors"),
    ("boards: [{name: a, url: http://h:1}", "<yaml>", "malformed"),
])
def test_malformed_fleet_files_are_refused_naming_the_field(tmp_path: Path, text: str, field: str,
                                                            words: str) -> None:
    with pytest.raises(FleetConfigError) as e:
        load_fleet(write(tmp_path, text))
    assert e.value.field == field, str(e.value)
    assert words in str(e.value)


def test_too_many_boards_and_too_large_files_are_refused(tmp_path: Path) -> None:
    many = "boards:\n" + "".join(f"  - {{name: b{i}, url: 'http://h:{1000 + i}'}}\n" for i in range(MAX_BOARDS + 1))
    with pytest.raises(FleetConfigError, match=f"at most {MAX_BOARDS}"):
        load_fleet(write(tmp_path, many))
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (300 * 1024))
    with pytest.raises(FleetConfigError, match="KiB"):
        load_fleet(big)
    with pytest.raises(FleetConfigError, match="not found"):
        load_fleet(tmp_path / "missing.yaml")
    with pytest.raises(FleetConfigError, match="not a regular file"):
        load_fleet(tmp_path)
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe boards")
    with pytest.raises(FleetConfigError, match="UTF-8"):
        load_fleet(tmp_path / "bin.yaml")


def test_connect_urls_become_boards_named_host_port() -> None:
    cfg = from_urls(["http://127.0.0.1:8080", "http://127.0.0.1:8081/"])
    assert [(b.name, b.url) for b in cfg.boards] == [("127.0.0.1-8080", "http://127.0.0.1:8080"),
                                                     ("127.0.0.1-8081", "http://127.0.0.1:8081")]
    with pytest.raises(FleetConfigError, match="twice"):
        from_urls(["http://h:1", "http://h:1/"])
    with pytest.raises(FleetConfigError, match="http"):
        from_urls(["h:1"])
