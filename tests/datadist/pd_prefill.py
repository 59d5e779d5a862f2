"""The prefill side of the P/D test, in its own process (JSON lines on stdin/stdout).

``prefill``: prefill the prompts, then answer with each request's block ids
and first generated token.  ``push``: the same, but with the decoder's block
ids and caches given first, so each layer is pushed while the next computes.
"""

from __future__ import annotations

import json
import sys

import torch
from pd_common import Side, jsonable

import kvfunc.datadist as dd


def prefill(side: Side, prompts: dict[str, list[int]]) -> None:
    for rid, tokens in prompts.items():
        assert side.mgr.allocate_slots(rid, 0, len(tokens))


def run(side: Side, prompts: dict[str, list[int]]) -> dict[str, int]:
    logits = side.step([(rid, 0, tokens) for rid, tokens in prompts.items()])
    return {rid: int(out[-1].argmax()) for rid, out in zip(prompts, logits, strict=True)}


def main() -> None:
    torch.set_num_threads(1)  # the test process computes too: do not oversubscribe
    role, cluster_id, options = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    cluster = dd.LLMDataDist(dd.LLMRole[role], cluster_id, options)
    side = Side(cluster.cache_manager)
    print(json.dumps({"ready": True, "listen": cluster.listen_address,
                      "layout": side.layout}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "exit":
            break
        prompts = command["prompts"]
        prefill(side, prompts)
        if command["op"] == "prefill":
            first = run(side, prompts)
        else:  # push: the decoder admitted the requests first and sent its block ids
            tasks = [task for rid in prompts for task in dd.push_request_blocks(
                cluster.cache_manager, side.paged, side.layout, command["layout"], 1,
                command["cache_ids"], side.mgr.get_block_ids(rid), command["block_ids"][rid],
                layer_synchronizer=side.signals)]
            first = run(side, prompts)
            for task in tasks:
                task.synchronize(30_000)
        blocks = {rid: jsonable(side.mgr.get_block_ids(rid)) for rid in prompts}
        print(json.dumps({"ok": True, "first": first, "block_ids": blocks}), flush=True)
    cluster.finalize()


if __name__ == "__main__":
    main()
