"""A stand-in for `python -m trainer.resident` that speaks the real channel
(trainer/channel.py) and trains nothing: for tests of the daemon's side
(rl/trainer_host.py) in milliseconds.  A job whose path ends in "slow" takes
30 s; "fail" answers failed.  Pings are answered from a thread, as the
resident trainer does."""

from __future__ import annotations

import os
import sys
import threading
import time

from trainer.channel import SOCKET_ENV, TOKEN_ENV, ChannelClosed, connect


def main() -> int:
    channel = connect(os.environ[SOCKET_ENV])
    channel.send({"op": "hello", "token": os.environ[TOKEN_ENV], "rank": 0, "world_size": 1,
                  "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "pid": os.getpid()})
    jobs: list[dict] = []
    ready = threading.Condition()

    def listen() -> None:
        while True:
            try:
                message = channel.recv()
            except ChannelClosed:
                os._exit(1)
            assert message is not None
            if message["op"] == "ping":
                channel.send({"op": "pong", "n": message["n"]})
            else:
                with ready:
                    jobs.append(message)
                    ready.notify()

    threading.Thread(target=listen, daemon=True).start()
    through = saved = -1
    while True:
        with ready:
            ready.wait_for(lambda: bool(jobs))
            message = jobs.pop(0)
        if message["op"] == "stop":
            return 0
        if message["op"] == "save":
            channel.send({"op": "saved", "iteration": through if through > saved else None})
            saved = through
        elif message["op"] == "train":
            if message["job"].endswith("slow"):
                time.sleep(30)
            if message["job"].endswith("fail"):
                channel.send({"op": "failed", "iteration": message["iteration"],
                              "error": "TrainError: the batch holds no samples"})
                return 2
            through = message["iteration"]
            channel.send({"op": "done", "iteration": through, "seconds": 0.01,
                          "train_seconds": 0.01, "step": 1, "saved_through": saved,
                          "gpu_mib": int(os.environ.get("FAKE_TRAINER_GPU_MIB", "0"))})


if __name__ == "__main__":
    sys.exit(main())
