"""A ServerApp that sends every node one message a round and times the round; writes
``<output-dir>/floor.json``: the rounds' seconds and every reply's metrics."""

import json
import time
from pathlib import Path

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    config = context.run_config
    deadline = time.monotonic() + float(config["round-timeout"])
    nodes = list(grid.get_node_ids())
    while len(nodes) < int(config["min-nodes"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        nodes = list(grid.get_node_ids())
    seconds, replies = [], []
    for _ in range(int(config["num-server-rounds"])):
        start = time.monotonic()
        received = grid.send_and_receive(
            [Message(RecordDict({}), dst_node_id=node, message_type=MessageType.TRAIN)
             for node in nodes], timeout=float(config["round-timeout"]))
        seconds.append(time.monotonic() - start)
        replies.append([dict(m.content["metrics"]) for m in received if m.has_content()])
    out = Path(str(config["output-dir"]) or ".")
    out.mkdir(parents=True, exist_ok=True)
    (out / "floor.json").write_text(json.dumps({"round_seconds": seconds,
                                                "replies": replies}))
