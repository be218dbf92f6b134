"""A ServerApp that waits for ``min-nodes`` nodes, asks each once before the rounds (a
preflight: a query message, answered at once), then sends every node one message a round and
times the round; writes ``<output-dir>/floor.json``: the preflight's and the rounds' seconds
and every round's reply metrics. It logs the app's milestones in the words of the app's own
lines (``[start]``, the preflight's answers, ``[final] wrote to``): bench/overhead.py reads
both apps' timelines from them."""

import json
import time
from logging import INFO
from pathlib import Path

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


def _exchange(grid: Grid, nodes: list[int], message_type: str, timeout: float
              ) -> tuple[float, list[dict]]:
    """One message to every node and their replies: (seconds, each reply's metrics)."""
    start = time.monotonic()
    received = grid.send_and_receive(
        [Message(RecordDict({}), dst_node_id=node, message_type=message_type)
         for node in nodes], timeout=timeout)
    return (time.monotonic() - start,
            [dict(m.content["metrics"]) for m in received if m.has_content()])


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    log(INFO, "[start] floor app")
    timeout = float(config["round-timeout"])
    deadline = time.monotonic() + timeout
    nodes = list(grid.get_node_ids())
    while len(nodes) < int(config["min-nodes"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        nodes = list(grid.get_node_ids())
    preflight = None
    if config["preflight"]:
        preflight, answers = _exchange(grid, nodes, MessageType.QUERY, timeout)
        log(INFO, "preflight: %d of %d nodes answered", len(answers), len(nodes))
    seconds, replies = [], []
    for _ in range(int(config["num-server-rounds"])):
        took, metrics = _exchange(grid, nodes, MessageType.TRAIN, timeout)
        seconds.append(took)
        replies.append(metrics)
    out = Path(str(config["output-dir"]) or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "floor.json").write_text(json.dumps({"preflight_seconds": preflight,
                                                "round_seconds": seconds,
                                                "replies": replies}))
    log(INFO, "[final] wrote to %s: floor.json", out)
