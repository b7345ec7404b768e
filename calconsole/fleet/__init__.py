"""Fleet: one console over many boards, each board its own server process.

The runtime drives one physical device per process (facts.md F1: "temporary only support one physical
device"), so many boards mean many server processes: one ``calconsole serve`` (or a stock llama-server)
per board. This package watches them all from one place:

- ``config``: the board list (``--fleet FILE`` YAML or repeated ``--connect URL``), bounded and checked;
- ``sample``: one poll of one board turned into a typed ``BoardSample`` (calconsole's ``/snapshot``, or
  llama-server's ``/health`` + ``/slots`` + ``/metrics``), and the worst-first ranking;
- ``poller``: one asyncio task per board with its own back-off, so a slow or dead board never delays the
  others;
- ``view``: the Textual fleet view (one row per board, worst first; Enter opens that board's console);
- ``launcher``: ``calconsole serve --boards N`` (N isolated simulator processes on consecutive ports).
"""
