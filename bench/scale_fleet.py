"""One process of bench/scale.py's simulated fleet: ``--producers K`` real producers in one
asyncio loop, sharing one in-process pool of ``--engines E`` sim engines.

Each producer is a full ``Producer`` (producer/worker.py) with a consumer name of its own,
its own Redis connection, its own liveness key and heartbeat thread, and its own follower of
the run's events (weight syncs): what Redis sees of it is what it sees of a producer process,
except the once-a-second run-identity check that ``rollstream produce`` makes per process
(made here by no one). The settings come from the ROLLSTREAM_* environment, as for
``rollstream produce``. SIGTERM stops every producer (they hand back what they hold).

    python bench/scale_fleet.py --producers 16 --engines 16 --name fleet-0
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

from rollstream.producer import worker
from rollstream.producer.assembly import build_producer
from rollstream.producer.fleet.pool import LocalPool
from rollstream.shared.connection import connect
from rollstream.shared.keys import Keys, Role
from rollstream.shared.liveness import Liveness
from rollstream.shared.settings import load_settings

log = logging.getLogger("bench.scale_fleet")


async def fleet(producers: int, engines: int, name: str) -> None:
    settings = load_settings(engines={"count": engines})
    loop = asyncio.get_running_loop()
    # the producers' off-loop Redis calls (admission, settles): the default executor has
    # min(32, cores + 4) threads, too few for K producers that each are a process of their own
    loop.set_default_executor(ThreadPoolExecutor(max_workers=4 * producers + 4))
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    pool = LocalPool.start(settings.engines)
    keys = Keys(settings.run)
    clients = [connect(settings.redis) for _ in range(producers)]
    names = [f"{name}-p{i}" for i in range(producers)]
    ttl = settings.process.liveness_ttl_s
    workers = [
        build_producer(
            client, settings, pool=pool, name=n, liveness=Liveness(client, keys, Role.PRODUCER, n, ttl)
        )
        for client, n in zip(clients, names, strict=True)
    ]
    log.info("fleet %s: %d producers on %d sim engines", name, producers, engines)
    await asyncio.gather(*(w.run(stop) for w in workers))
    for client in clients:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--producers", type=int, required=True)
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("--name", required=True, help="prefix of the producers' consumer names")
    parser.add_argument(
        "--poll-s",
        type=float,
        default=None,
        help="diagnosis only: the producers' POLL_S (default 0.05), where idle looks back off from",
    )
    args = parser.parse_args()
    if args.poll_s is not None:  # how often a producer with no work looks for some
        worker.POLL_S = args.poll_s
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(fleet(args.producers, args.engines, args.name))


if __name__ == "__main__":
    main()
