from __future__ import annotations

import pytest

from calconsole.layout import LayoutError, available_layouts, load_layout


def test_shipped_layouts():
    assert {"operator", "chat"} <= set(available_layouts())
    op = load_layout("operator")
    assert sorted(op.panes()) == ["chat", "maintenance", "observation"]
    assert op.refresh_hz == 2
    chat = load_layout("chat")
    widths = {c.panes[0].pane: c.width for c in chat.columns}
    assert widths["chat"] == "3fr" and widths["observation"] == "2fr"  # chat large, observation narrow


@pytest.mark.parametrize("text, field", [
    ("columns: [", "<yaml>"),
    ("refresh_hz: 50\ncolumns: [{panes: [{pane: chat}]}]", "refresh_hz"),
    ("columns: []", "columns"),
    ("columns: [{width: wide, panes: [{pane: chat}]}]", "columns[0].width"),
    ("columns: [{panes: [{pane: chat}, {pane: chat}]}]", "columns[0].panes[1].pane"),
])
def test_broken_layouts_name_file_and_field(tmp_path, text, field):
    p = tmp_path / "l.yaml"
    p.write_text(text)
    with pytest.raises(LayoutError) as e:
        load_layout(str(p))
    assert e.value.field == field and str(p) in str(e.value)


def test_without_drops_a_pane():
    op = load_layout("operator").without("maintenance")
    assert "maintenance" not in op.panes()


def test_binary_layout_file_is_a_layout_error(tmp_path):
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"\x7fELF\x02\x01\xff\xfe")
    with pytest.raises(LayoutError) as e:
        load_layout(str(p))
    assert e.value.field == "<file>"
